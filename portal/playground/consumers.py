"""The playground's websocket: authenticate from the session, check the tenant membership,
run one chat at a time through the gateway pipeline (playground.services), forward its
deltas, and cancel it on request or disconnect. A chat may ask for up to three models at once
(side by side): each is a column, a request of its own (its own request id, quota admission,
ledger row, Stop, timings and errors), all streamed over this one socket.

Client → server:  {"type": "chat", "model" | "models", "messages", "max_tokens"?, "temperature"?,
                   "json_schema"?, "tools"?, "tool_choice"?}   (`models`: 1 to 3 distinct ids, one
                                                            per column; the last three: the boxes'
                                                            text, see services.playground_constraints)
                  {"type": "cancel", "column"?}            (no column: every running column)
                  {"type": "feedback", "completion_id", "rating": "up" | "down", "comment"?}
Server → client:  {"type": "ready", "tenant"}
                  {"type": "start", "column", "request_id", "model"}
                  {"type": "delta", "column", "text"}     (model output: plain text, never markup)
                  {"type": "tool_calls", "column", "tool_calls": [{"id", "type", "function": {"name", "arguments"}}]}
                                                          (reassembled from the stream's deltas)
                  {"type": "usage", "column", "prompt_tokens", "completion_tokens"}
                  {"type": "done", "column", "request_id", "completion_id", "finish_reason", "ttft_ms",
                   "tokens_per_second"}
                  {"type": "cancelled", "column", "request_id", "completion_id"}
                  {"type": "feedback", "completion_id", "rating"}   (recorded)
                  {"type": "error", "status", "code", "message", "param"?, "column"?, "completion_id"?}
                                                          (with a column: that column's request failed;
                                                           with a completion id: that rating was not
                                                           recorded; else the message was refused,
                                                           nothing ran)
`completion_id` is the id the answer's chunks carried (chatcmpl-...; null when none came): the
one feedback names. Refused connections close with 4401 (no session) or 4404 (not a member,
unknown tenant).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from portal.core.exceptions import InvalidInput
from portal.gateway.errors import GatewayError
from portal.gateway.services import new_request_id
from portal.playground.services import (
    playground_columns,
    playground_columns_check,
    playground_completion_stream,
    playground_constraints,
    playground_feedback,
)
from portal.rollouts.services import CompletionNotFound
from portal.tenants.models import Membership
from portal.tenants.selectors import membership_get, tenant_get_by_slug

CHAT_FIELDS = ("messages", "max_tokens", "temperature")
CLOSE_UNAUTHENTICATED = 4401
CLOSE_NOT_FOUND = 4404

log = logging.getLogger(__name__)


@database_sync_to_async
def _membership(user, slug: str) -> Membership | None:
    tenant = tenant_get_by_slug(slug=slug)
    if tenant is None:
        return None
    membership = membership_get(tenant=tenant, user=user)
    if membership is not None:
        membership.tenant = tenant
    return membership


@dataclass
class Column:
    """One model's request in the running chat."""

    index: int
    request_id: str
    task: asyncio.Task | None = None
    completion_id: str | None = None  # the chunks' id, once the first one came


class PlaygroundConsumer(AsyncJsonWebsocketConsumer):
    # No channel layer: nothing is ever sent to a playground socket from outside it. With the
    # default (Redis) layer every socket also sat in a 5 s BZPOPMIN on its own channel, which
    # redis-py reads with a 5 s socket timeout: when the answer came a little late (a busy
    # loop), the read raised TimeoutError out of the consumer and the socket dropped mid-chat.
    channel_layer_alias = None
    membership: Membership | None = None

    async def connect(self) -> None:
        self.columns: dict[int, Column] = {}  # the running chat's columns, by index
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        self.membership = await _membership(user, self.scope["url_route"]["kwargs"]["slug"])
        if self.membership is None:
            await self.close(code=CLOSE_NOT_FOUND)
            return
        await self.accept()
        await self.send_json({"type": "ready", "tenant": self.membership.tenant.slug})

    async def disconnect(self, code: int) -> None:
        for column in list(getattr(self, "columns", {}).values()):
            await self._cancel(column)

    async def receive_json(self, content, **kwargs) -> None:
        kind = content.get("type") if isinstance(content, dict) else None
        if kind == "cancel":
            await self._receive_cancel(content)
            return
        if kind == "feedback":
            await self._receive_feedback(content)
            return
        if kind != "chat":
            await self._error(400, "invalid_message", 'send {"type": "chat", ...} or {"type": "cancel"}')
            return
        if self._running():
            await self._error(409, "busy", "a generation is already running; stop it first")
            return
        # Membership, role and the tenant's status as of now, not as of the connection.
        self.membership = await _membership(self.scope["user"], self.membership.tenant.slug)
        if self.membership is None:
            await self._error(404, "not_found", "you are no longer a member of this tenant")
            await self.close(code=CLOSE_NOT_FOUND)
            return
        if self.membership.role == Membership.Role.VIEWER:
            await self._error(403, "read_only", "viewers cannot run generations in this tenant")
            return
        body = {name: content[name] for name in CHAT_FIELDS if name in content}
        try:
            models = playground_columns(model=content.get("model"), models=content.get("models"))
            body.update(playground_constraints(json_schema=content.get("json_schema"), tools=content.get("tools"),
                                               tool_choice=content.get("tool_choice")))
            if len(models) > 1:  # one column's refusal is the pipeline's own, with its ledger row
                await playground_columns_check(tenant=self.membership.tenant, body=body, models=models)
        except GatewayError as exc:  # a bad list or box, an unknown model: said in the page, nothing sent
            await self._error(exc.status, exc.code, exc.message, exc.param)
            return
        self.columns = {}
        for index, model in enumerate(models):
            column = Column(index=index, request_id=new_request_id())
            request = dict(body, model=model) if model is not None else body
            column.task = asyncio.create_task(self._generate(request, column))
            self.columns[index] = column

    async def receive(self, text_data=None, bytes_data=None, **kwargs) -> None:
        try:
            content = await self.decode_json(text_data) if text_data else None
        except ValueError:
            content = None
        await self.receive_json(content)

    async def _receive_feedback(self, content: dict) -> None:
        """Record a thumbs up/down on an answer; the reply (or the error) names its completion id."""
        completion_id = content.get("completion_id")
        said = completion_id if isinstance(completion_id, str) else None
        self.membership = await _membership(self.scope["user"], self.membership.tenant.slug)
        if self.membership is None:
            await self._error(404, "not_found", "you are no longer a member of this tenant", completion_id=said)
            await self.close(code=CLOSE_NOT_FOUND)
            return
        if self.membership.role == Membership.Role.VIEWER:
            await self._error(403, "read_only", "viewers cannot rate answers in this tenant", completion_id=said)
            return
        try:
            feedback = await database_sync_to_async(playground_feedback)(
                tenant=self.membership.tenant, user=self.scope["user"], completion_id=completion_id,
                rating=content.get("rating"), comment=content.get("comment", ""))
        except InvalidInput as exc:
            await self._error(400, "invalid_feedback", exc.message, exc.field, completion_id=said)
            return
        except CompletionNotFound as exc:
            await self._error(404, "completion_not_found", exc.message, exc.field, completion_id=said)
            return
        await self.send_json({"type": "feedback", "completion_id": feedback.completion_id, "rating": feedback.rating})

    def _running(self) -> list[Column]:
        return [c for c in self.columns.values() if c.task is not None and not c.task.done()]

    async def _receive_cancel(self, content: dict) -> None:
        """Stop one column (`column`: its index) or, without one, every running column."""
        index = content.get("column")
        if index is not None and (not isinstance(index, int) or isinstance(index, bool)):
            await self._error(400, "invalid_message", "column: must be the index of a column (0, 1, 2)")
            return
        columns = self._running() if index is None else [c for c in self._running() if c.index == index]
        for column in columns:  # a column that just ended is not "cancelled": its done was sent
            if await self._cancel(column):
                await self.send_json({"type": "cancelled", "column": column.index, "request_id": column.request_id,
                                      "completion_id": column.completion_id})

    async def _cancel(self, column: Column) -> bool:
        """Stop the column's generation (closing the worker's stream aborts its request)."""
        task, column.task = column.task, None
        if task is None or task.done():
            return False
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return True

    async def _error(self, status: int, code: str | None, message: str, param: str | None = None,
                     column: int | None = None, completion_id: str | None = None) -> None:
        error = {"type": "error", "status": status, "code": code, "message": message}
        if param is not None:
            error["param"] = param
        if column is not None:
            error["column"] = column
        if completion_id is not None:  # a rating that was not recorded: the page marks that answer
            error["completion_id"] = completion_id
        await self.send_json(error)

    async def _generate(self, body: dict, column: Column) -> None:
        index, request_id = column.index, column.request_id
        started = time.monotonic()
        first: float | None = None
        tokens = 0
        finish_reason = None
        tool_calls: dict[int, dict] = {}  # by the deltas' index
        try:
            completion = await playground_completion_stream(
                tenant=self.membership.tenant, body=body, request_id=request_id)
        except GatewayError as exc:
            await self._error(exc.status, exc.code, exc.message, exc.param, column=index)
            return
        except Exception:  # the ledger row is written (status 500); the page must not hang
            log.exception("playground request %s failed", request_id)
            await self._error(500, "internal_error", "The playground failed to run the request; try again.",
                              column=index)
            return
        try:
            await self.send_json({"type": "start", "column": index, "request_id": request_id,
                                  "model": completion.model})
            async with contextlib.aclosing(completion.chunks()) as chunks:
                async for chunk in chunks:
                    if "error" in chunk:
                        error = chunk["error"]
                        await self._error(502, error.get("code"), str(error.get("message") or "the worker failed"),
                                          column=index)
                        continue
                    if column.completion_id is None and isinstance(chunk.get("id"), str):
                        column.completion_id = chunk["id"]
                    usage = chunk.get("usage")
                    if isinstance(usage, dict):
                        tokens = int(usage.get("completion_tokens") or 0)
                        await self.send_json({"type": "usage", "column": index,
                                              "prompt_tokens": usage.get("prompt_tokens"),
                                              "completion_tokens": usage.get("completion_tokens")})
                    for choice in chunk.get("choices") or []:
                        finish_reason = choice.get("finish_reason") or finish_reason
                        delta = choice.get("delta") or {}
                        if (delta.get("content") or delta.get("tool_calls")) and first is None:
                            first = time.monotonic()
                        _gather_tool_calls(tool_calls, delta.get("tool_calls"))
                        if delta.get("content"):
                            await self.send_json({"type": "delta", "column": index, "text": delta["content"]})
        finally:
            await completion.aclose()  # a no-op once the chunks started: they write the ledger
        if tool_calls:
            await self.send_json({"type": "tool_calls", "column": index,
                                  "tool_calls": [tool_calls[i] for i in sorted(tool_calls)]})
        now = time.monotonic()
        decode = now - first if first is not None else 0.0
        await self.send_json({
            "type": "done", "column": index, "request_id": request_id, "completion_id": column.completion_id,
            "finish_reason": finish_reason,
            "ttft_ms": round((first - started) * 1000, 1) if first is not None else None,
            "tokens_per_second": round((tokens - 1) / decode, 1) if tokens > 1 and decode > 0 else None,
        })


def _gather_tool_calls(calls: dict[int, dict], deltas) -> None:
    """Fold one chunk's tool-call deltas into `calls`, as the OpenAI SDK reassembles them: the
    first delta of a call carries its id and name, the next ones pieces of its arguments."""
    for piece in deltas if isinstance(deltas, list) else ():
        if not isinstance(piece, dict):
            continue
        index = piece.get("index") if isinstance(piece.get("index"), int) else len(calls)
        call = calls.setdefault(index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        if isinstance(piece.get("id"), str):
            call["id"] = piece["id"]
        function = piece.get("function") if isinstance(piece.get("function"), dict) else {}
        for name in ("name", "arguments"):
            if isinstance(function.get(name), str):
                call["function"][name] += function[name]
