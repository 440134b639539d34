"""The inference worker's command line: one base model, many LoRA adapters.

  python -m inference generate --prompt "..." [--lora NAME=PATH]   generate from the command line
  python -m inference serve [MODEL] --port 8001                    the OpenAI-compatible HTTP server

`generate` streams the text to stdout as it is generated and a one-line summary (tokens, speed,
finish reason) to stderr; `--chat` wraps the prompt as a user message in the model's chat
template, `--lora NAME=PATH` applies a PEFT adapter directory. `serve` takes vLLM's flags
(inference/server/cli.py). Each subcommand's --help shows every flag's default and the
INFERENCE_* variable behind it. Bad flags or values print one clear line and exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from inference.config import ConfigError
from inference.engine.sampling_params import SamplingParams
from inference.server.cli import add_serve_parser, engine_flag_help, flag_help, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m inference", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt",
                         description="Generate text for one prompt, streamed to stdout (a summary goes to stderr).")
    gen.add_argument("--model", help=engine_flag_help("a .gguf file or an HF checkpoint directory", "model",
                                                      default="the fetched SmolLM2"))
    gen.add_argument("--prompt", required=True, help="the prompt (required)")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message [default: off]")
    gen.add_argument("--system", help="a system message (with --chat) [default: none]")
    gen.add_argument("--lora", metavar="NAME=PATH",
                     help="apply a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) "
                          "[default: none: the base model]")
    gen.add_argument("--max-lora-rank", type=int,
                     help=engine_flag_help("largest adapter rank accepted (with --lora)", "max_lora_rank"))
    gen.add_argument("--max-tokens", type=int, default=128, help=flag_help("tokens to generate at most", default=128))
    gen.add_argument("--temperature", type=float, default=0.0, help=flag_help("0: greedy", default=0.0))
    gen.add_argument("--top-p", type=float, default=1.0, help=flag_help("nucleus sampling", default=1.0))
    gen.add_argument("--top-k", type=int, default=0, help=flag_help("0: off", default=0))
    gen.add_argument("--seed", type=int, help=flag_help("sampling seed", default="none"))
    gen.add_argument("--stop", action="append", default=[], help=flag_help("a stop string (repeatable)", default="none"))
    gen.add_argument("--dtype", choices=["bfloat16", "float32", "float16"],
                     help=engine_flag_help("weights and activations", "dtype"))
    gen.add_argument("--weights-dtype", choices=["auto", "int8", "int4"],
                     help=engine_flag_help("auto: dense weights in --dtype; int8 / int4: weight-only quantised "
                                           "projections (CPU)", "weights_dtype"))
    gen.add_argument("--device", help=engine_flag_help("cpu or cuda[:N]", "device"))
    add_serve_parser(sub)
    return parser


def lora_argument(value: str | None) -> tuple[str, str] | None:
    """`--lora NAME=PATH` -> (name, path); ConfigError naming the flag otherwise."""
    if value is None:
        return None
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ConfigError("--lora", f"expected NAME=PATH, got {value!r}")
    path = os.path.expanduser(path)
    if not os.path.isdir(path):
        raise ConfigError("--lora", f"{name}: {path} is not a directory")
    return name, path


def generate(args: argparse.Namespace) -> int:
    lora = lora_argument(args.lora)
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
    llm = LLM(args.model, progress=True, dtype=args.dtype, weights_dtype=args.weights_dtype, device=args.device,
              max_lora_rank=args.max_lora_rank)
    if lora is not None:  # validated and loaded now, so a bad adapter is one clear line (exit 2)
        llm.add_adapter(*lora)
    messages = None
    prompt = args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        prompt = None
    start = time.perf_counter()
    final = None
    for out in llm.stream(prompt, params, messages=messages, lora=lora[0] if lora else None):
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
