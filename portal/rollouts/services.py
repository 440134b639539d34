"""Writes for safe rollouts.

    feedback_record(tenant=, completion_id=, rating=, comment=, source=, user=)   one per
        completion per source; a second call updates it. InvalidInput for a bad rating, source or
        comment; CompletionNotFound for an id that is not one of the tenant's completions.
    canary_guard_update(deployment=, actor=, enabled=, min_requests=, error_rate_margin=,
        ttft_p95_factor=)   the guard's thresholds (InvalidInput naming the field); audited.
    canary_guard_dismiss(deployment=, actor=)   hide the rollback banner.
    canary_guard_check(deployment_id=)   judge each canary of the deployment; roll back the failing
        ones (weight 0 through portal.adapters.deployments, actor None) with an AuditEvent.
"""

from __future__ import annotations

import logging
import math

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.utils import timezone

from portal.adapters.deployments import deployment_set_weights
from portal.adapters.models import AuditEvent, Deployment
from portal.core.exceptions import InvalidInput
from portal.rollouts import selectors
from portal.rollouts.models import (
    COMMENT_MAX_LENGTH,
    COMPLETION_ID_MAX_LENGTH,
    CanaryGuard,
    Feedback,
)
from portal.tenants.models import Tenant

log = logging.getLogger(__name__)


class CompletionNotFound(LookupError):
    """No completion of this tenant has that id (unknown, or another tenant's: the same answer)."""

    def __init__(self, completion_id: str):
        super().__init__(f"No completion with id {completion_id[:80]!r} was found.")
        self.field = "id"
        self.message = str(self)


# -- feedback ---------------------------------------------------------------------------------
def feedback_record(*, tenant: Tenant, completion_id: str, rating: str, comment: str = "", source: str,
                    user: AbstractBaseUser | None = None) -> Feedback:
    """Record (or replace) `source`'s rating of the tenant's completion `completion_id`."""
    if not isinstance(completion_id, str) or not completion_id.strip():
        raise InvalidInput("id", "the completion's id (the \"id\" of its response, e.g. chatcmpl-...) is required")
    if len(completion_id) > COMPLETION_ID_MAX_LENGTH:
        raise InvalidInput("id", f"at most {COMPLETION_ID_MAX_LENGTH} characters")
    if rating not in Feedback.Rating.values:
        raise InvalidInput("rating", f"one of \"up\" or \"down\", got {str(rating)[:40]!r}")
    if source not in Feedback.Source.values:
        raise InvalidInput("source", f"one of {Feedback.Source.values}, got {str(source)[:40]!r}")
    if comment is None:
        comment = ""
    if not isinstance(comment, str):
        raise InvalidInput("comment", "must be a string")
    if len(comment) > COMMENT_MAX_LENGTH:
        raise InvalidInput("comment", f"at most {COMMENT_MAX_LENGTH} characters, got {len(comment)}")
    record = selectors.completion_record_get(tenant=tenant, completion_id=completion_id)
    if record is None:
        raise CompletionNotFound(completion_id)
    user = user if user is not None and getattr(user, "is_authenticated", False) else None
    values = {"usage_record": record, "adapter_version_id": record.adapter_version_id, "rating": rating,
              "comment": comment.replace("\x00", ""), "user": user}
    try:
        with transaction.atomic():
            feedback, _ = Feedback.objects.update_or_create(
                tenant=tenant, completion_id=completion_id, source=source, defaults=values)
    except IntegrityError:  # two first ratings at once: the other inserted; this one updates it
        feedback, _ = Feedback.objects.update_or_create(
            tenant=tenant, completion_id=completion_id, source=source, defaults=values)
    return feedback


# -- the canary guard -------------------------------------------------------------------------
def _number(field: str, value, *, low: float, high: float, integer: bool = False):
    if isinstance(value, bool) or not isinstance(value, int | float) or (integer and not isinstance(value, int)):
        raise InvalidInput(field, f"must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not math.isfinite(value) or not low <= value <= high:
        raise InvalidInput(field, f"must be between {low:g} and {high:g}, got {value!r}")
    return value


def canary_guard_update(*, deployment: Deployment, actor: AbstractBaseUser | None, enabled: bool | None = None,
                        min_requests: int | None = None, error_rate_margin: float | None = None,
                        ttft_p95_factor: float | None = None) -> CanaryGuard:
    """Change any of the guard's settings (the others stay); nothing changes if one is bad."""
    changes: dict = {}
    if enabled is not None:
        if not isinstance(enabled, bool):
            raise InvalidInput("enabled", f"must be true or false, got {enabled!r}")
        changes["enabled"] = enabled
    if min_requests is not None:
        changes["min_requests"] = _number("min_requests", min_requests, low=1, high=1_000_000, integer=True)
    if error_rate_margin is not None:
        changes["error_rate_margin"] = float(_number("error_rate_margin", error_rate_margin, low=0.0, high=1.0))
    if ttft_p95_factor is not None:
        changes["ttft_p95_factor"] = float(_number("ttft_p95_factor", ttft_p95_factor, low=1.0, high=1000.0))
    with transaction.atomic():
        guard = CanaryGuard.objects.select_for_update().get_or_create(deployment=deployment)[0]
        for name, value in changes.items():
            setattr(guard, name, value)
        guard.save()
        if changes:
            AuditEvent.objects.create(
                tenant_id=deployment.adapter.tenant_id, actor=_actor(actor), action="deployment.canary_guard_set",
                target=deployment.adapter.public_id, details=changes)
    return guard


def canary_guard_dismiss(*, deployment: Deployment, actor: AbstractBaseUser | None) -> CanaryGuard:
    """Hide the last rollback's banner (the audit event stays)."""
    guard = selectors.canary_guard_get(deployment=deployment)
    if not guard.banner_dismissed:
        guard.banner_dismissed = True
        guard.save(update_fields=["banner_dismissed", "updated_at"])
    return guard


def _actor(actor):
    return actor if actor is not None and getattr(actor, "is_authenticated", False) else None


def canary_verdict(*, guard: CanaryGuard, canary: dict, stable: dict) -> list[str]:
    """Why the canary fails its guard ([] = it does not, or too few requests to tell)."""
    if canary["requests"] < guard.min_requests:
        return []
    reasons = []
    stable_rate = stable["error_rate"] or 0.0  # a stable version with no requests: no errors seen
    if canary["error_rate"] > stable_rate + guard.error_rate_margin:
        reasons.append("error_rate")
    if (canary["ttft_p95_ms"] is not None and stable["ttft_p95_ms"] is not None
            and canary["ttft_p95_ms"] > stable["ttft_p95_ms"] * guard.ttft_p95_factor):
        reasons.append("ttft_p95")
    return reasons


def canary_guard_check(*, deployment_id: int) -> list[int]:
    """Judge the deployment's canaries now; returns the version numbers rolled back."""
    deployment = Deployment.objects.select_related("adapter__tenant").filter(pk=deployment_id).first()
    if deployment is None:
        return []
    guard = selectors.canary_guard_get(deployment=deployment)
    if not guard.enabled:
        return []
    stable_number, canaries = selectors.deployment_roles(deployment=deployment)
    rolled_back = []
    versions = {v.number: v for v in deployment.adapter.versions.filter(number__in=[stable_number, *canaries])}
    for number in canaries:
        since = selectors.canary_window_start(deployment=deployment, number=number)
        canary = selectors.canary_figures(version=versions[number], since=since)
        stable = selectors.canary_figures(version=versions[stable_number], since=since)
        reasons = canary_verdict(guard=guard, canary=canary, stable=stable)
        if reasons and _roll_back(deployment=deployment, guard=guard, number=number, since=since, reasons=reasons,
                                  canary=canary, stable=stable):
            rolled_back.append(number)
    CanaryGuard.objects.filter(pk=guard.pk).update(last_checked_at=timezone.now())
    return rolled_back


def _roll_back(*, deployment: Deployment, guard: CanaryGuard, number: int, since, reasons: list[str],
               canary: dict, stable: dict) -> bool:
    adapter = deployment.adapter
    figures = {
        "version": number, "stable_version": stable["version"], "reasons": reasons, "since": since.isoformat(),
        "canary": canary, "stable": stable,
        "thresholds": {"min_requests": guard.min_requests, "error_rate_margin": guard.error_rate_margin,
                       "ttft_p95_factor": guard.ttft_p95_factor},
    }
    with transaction.atomic():
        current = Deployment.objects.select_for_update().get(pk=deployment.pk)
        if int((current.weights or {}).get(str(number), 0)) <= 0:
            return False  # someone set the weights since this check read them
        weights = {int(n): w for n, w in current.weights.items()}
        weights[number] = 0
        try:
            deployment_set_weights(adapter=adapter, weights=weights, actor=None)
        except InvalidInput as error:  # e.g. another weighted version was retired meanwhile
            log.warning("canary guard could not roll back %s@v%d: %s", adapter.public_id, number, error)
            return False
        event = AuditEvent.objects.create(tenant_id=adapter.tenant_id, actor=None, action=selectors.ROLLED_BACK,
                                          target=f"{adapter.public_id}@v{number}", details=figures)
        CanaryGuard.objects.filter(pk=guard.pk).update(
            rolled_back_version=current.adapter.versions.filter(number=number).first(), rolled_back_at=event.created_at,
            rollback_figures=figures, rollback_event_id=event.pk, banner_dismissed=False)
    log.warning("canary guard rolled back %s@v%d (%s)", adapter.public_id, number, ", ".join(reasons))
    return True
