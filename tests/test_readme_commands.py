"""The README's inference-worker examples work as written: every `curl` to the worker
(localhost:8001) in its fenced code blocks, and the Python example that talks to the worker, run
against a real `python -m inference serve` on the default SmolLM2 GGUF, started with the
environment and flags of the serve command in the curls' block (plus float32 and a small KV cache,
to start fast on a CPU). Only the host and port are substituted (the worker runs on a free port);
curl prints the HTTP status after the body through a curlrc (`CURL_HOME`), the commands stay as
written."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from inference.models.fetch import default_model_path
from tests.inference.server.server_process import ServerProcess, start_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# Seconds: a few of work on an idle 2-core CPU; minutes when the machine runs much else beside.
COMMAND_TIMEOUT_S = 300
WORKER_ADDRESS = re.compile(r"(?:localhost|127\.0\.0\.1):8001")


def fenced_blocks(markdown: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced code block, indented ones (in list items) dedented."""
    blocks = []
    for m in re.finditer(r"^( *)```(\w*)\n(.*?)^\1```", markdown, flags=re.MULTILINE | re.DOTALL):
        indent = len(m.group(1))
        code = "\n".join(line[indent:] for line in m.group(3).splitlines())
        blocks.append((m.group(2), code))
    return blocks


def worker_curls(markdown: str) -> list[str]:
    """Every shell command in a bash block that starts with `curl` and calls the worker; a
    command runs on until the next line that starts a new one."""
    commands = []
    for language, code in fenced_blocks(markdown):
        if language not in ("bash", "sh", "shell"):
            continue
        current: list[str] | None = None
        for line in code.splitlines():
            if line.startswith("curl "):
                current = [line]
                commands.append(current)
            elif current is not None and (current[-1].rstrip().endswith("\\") or _open_quote(current)):
                current.append(line)
            else:
                current = None
    return ["\n".join(lines) for lines in commands if WORKER_ADDRESS.search(lines[0])]


def worker_serve_command(markdown: str) -> tuple[dict[str, str], list[str]]:
    """The environment and the arguments after `serve` of the command that starts the worker in
    the block of the worker's curls, less `--host` / `--port` (substituted)."""
    for language, code in fenced_blocks(markdown):
        if language != "bash" or not re.search(r"^curl .*" + WORKER_ADDRESS.pattern, code, flags=re.MULTILINE):
            continue
        for line in code.splitlines():
            if " -m inference serve" not in line:
                continue
            words = shlex.split(line, comments=True)
            env = {}
            while "=" in words[0]:
                name, _, value = words.pop(0).partition("=")
                env[name] = value
            args = [w for w in words[words.index("serve") + 1 :] if w != "&"]
            for flag in ("--host", "--port"):
                if flag in args:
                    del args[args.index(flag) : args.index(flag) + 2]
            return env, args
    raise AssertionError("no `python -m inference serve` in the block of the README's worker curls")


def _open_quote(lines: list[str]) -> bool:
    """Whether a single-quoted argument (a JSON body over several lines) is still open."""
    return "\n".join(lines).count("'") % 2 == 1


def worker_python_examples(markdown: str) -> list[str]:
    return [code for language, code in fenced_blocks(markdown)
            if language == "python" and re.search(r"base_url=\"http://" + WORKER_ADDRESS.pattern, code)]


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> ServerProcess:
    """The worker as the README starts it for these examples (the default model under its own
    name), with a small KV cache and float32 to start fast on a CPU."""
    model = default_model_path()
    if not model.exists():
        pytest.fail(f"{model} is missing: run `python -m inference.models fetch` (make test does)")
    env, args = worker_serve_command(README.read_text(encoding="utf-8"))
    proc = start_server([*args, "--dtype", "float32", "--kv-cache-memory", "64MiB"],
                        tmp_path_factory.mktemp("readme") / "worker.log", env=env)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def curl_home(tmp_path_factory) -> Path:
    """A curlrc that makes every curl print `HTTP <status>` on a line after the body."""
    home = tmp_path_factory.mktemp("curl")
    (home / ".curlrc").write_text('write-out = "\\nHTTP %{http_code}\\n"\n')
    return home


def run_curl(command: str, worker: ServerProcess, curl_home: Path) -> tuple[int, str]:
    """Run one README command with the worker's address, from the repository root (where the
    README's relative paths point); return the HTTP status and the body."""
    command = WORKER_ADDRESS.sub(worker.url.removeprefix("http://"), command)
    out = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                         env={"PATH": os.environ["PATH"], "CURL_HOME": str(curl_home)})
    assert out.returncode == 0, f"{command}\n{out.stderr}"
    body, _, status = out.stdout.rstrip("\n").rpartition("\nHTTP ")
    return int(status), body


def check_chat(body: str) -> None:
    answer = json.loads(body)
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] > 0


def check_load(body: str) -> None:
    adapter = json.loads(body)
    assert adapter["object"] == "adapter"


def check_completion(body: str) -> None:
    """A completion, streamed (SSE `data:` events ending with [DONE]) or not."""
    if body.lstrip().startswith("data:"):
        events = [line.removeprefix("data: ") for line in body.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks and all(c["object"] == "text_completion" for c in chunks)
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    else:
        answer = json.loads(body)
        assert answer["object"] == "text_completion" and answer["choices"][0]["text"]


CHECKS = {
    "/v1/chat/completions": check_chat,
    "/v1/load_lora_adapter": check_load,
    "/v1/completions": check_completion,
}


def test_the_readme_has_worker_examples_this_module_can_run() -> None:
    curls = worker_curls(README.read_text(encoding="utf-8"))
    assert any("/v1/chat/completions" in c for c in curls), curls
    for command in curls:
        assert _route(command) in CHECKS, f"no check for this README command:\n{command}"
    assert len(worker_python_examples(README.read_text(encoding="utf-8"))) >= 1
    env, args = worker_serve_command(README.read_text(encoding="utf-8"))
    assert "--port" not in args and all(name.startswith("INFERENCE_") for name in env)


def _route(command: str) -> str:
    return re.search(WORKER_ADDRESS.pattern + r"(/[\w/]+)", command).group(1)


def test_every_worker_curl_in_the_readme_answers_200_with_an_openai_shaped_body(worker, curl_home) -> None:
    # In README order: a later command may use what an earlier one set up (a loaded adapter).
    for command in worker_curls(README.read_text(encoding="utf-8")):
        status, body = run_curl(command, worker, curl_home)
        assert status == 200, f"{command}\n-> {status} {body}"
        CHECKS[_route(command)](body)


def test_the_readme_python_example_for_the_worker_runs(worker) -> None:
    for code in worker_python_examples(README.read_text(encoding="utf-8")):
        code = WORKER_ADDRESS.sub(worker.url.removeprefix("http://"), code)
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        assert out.returncode == 0, f"{code}\n{out.stderr}"
        assert "completion_tokens=" in out.stdout  # the usage chunk, printed last
