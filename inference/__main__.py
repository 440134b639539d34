"""`python -m inference generate --model PATH --prompt "..."`: generate from the command line;
`python -m inference serve --model PATH --port 8001`: the OpenAI-compatible HTTP server
(inference/server/cli.py has its flags).

Text streams to stdout as it is generated; a one-line summary (tokens, speed, finish
reason) goes to stderr. `--chat` wraps the prompt as a user message in the model's chat
template. Bad flags or values print one clear line and exit 2.
"""

from __future__ import annotations

import argparse
import sys
import time

from inference.config import ConfigError
from inference.engine.sampling_params import SamplingParams
from inference.server.cli import add_serve_parser, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m inference", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("--model", help="a .gguf file or an HF checkpoint directory (default: the fetched SmolLM2)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--system", help="a system message (with --chat)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    gen.add_argument("--dtype", choices=["bfloat16", "float32", "float16"])
    gen.add_argument("--device")
    add_serve_parser(sub)
    return parser


def generate(args: argparse.Namespace) -> int:
    # Imported only to generate: the engine's chain (torch, loaders, tokenizers) costs ~1.3 s on
    # a 2-core box (python -X importtime), which `--help`, a bad flag and `serve` don't pay here.
    from inference.llm import LLM

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    llm = LLM(args.model, progress=True, dtype=args.dtype, device=args.device)
    messages = None
    prompt = args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        prompt = None
    start = time.perf_counter()
    final = None
    for out in llm.stream(prompt, params, messages=messages):
        sys.stdout.write(out.delta_text)
        sys.stdout.flush()
        final = out
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    n = final.usage.completion_tokens
    print(
        f"[{n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tok/s, time to first token "
        f"{final.time_to_first_token or 0:.3f}s, finish_reason={final.finish_reason}]",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return generate(args)
        if args.command == "serve":
            return serve(args)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
