"""The `kog` command line."""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_info(args: argparse.Namespace) -> int:
    from kog.info import backend_info, format_backend_info

    info = backend_info()
    print(json.dumps(info, indent=2) if args.json else format_backend_info(info))
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from collections import Counter

    from kog.errors import ModelLoadError
    from kog.loader.convert import convert_gguf
    from kog.loader.gguf_write import hf_to_gguf, requantize_gguf
    from kog.loader.hub import resolve_model

    to_gguf = str(args.out).endswith(".gguf")
    try:
        path = resolve_model(args.model)
        if path.suffix != ".gguf" and not to_gguf:
            raise ModelLoadError(f"{path}: already an HF folder; it converts to a .gguf file")
        if to_gguf:
            write = requantize_gguf if path.suffix == ".gguf" else hf_to_gguf
            written = write(path, args.out, args.outtype or "f16")
        elif args.outtype:
            raise ModelLoadError("--outtype is for a .gguf output; an HF folder takes --dtype")
        else:
            out = convert_gguf(path, args.out, dtype=args.dtype, progress=False if args.no_progress else None)
    except ModelLoadError as e:
        print(f"kog convert: {e}", file=sys.stderr)
        return 1
    if to_gguf:
        counts = ", ".join(f"{n} {t}" for t, n in sorted(Counter(written.values()).items()))
        print(f"{args.out}: {len(written)} tensors ({counts})")
    else:
        print(out)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from kog.generate_cli import run

    return run(args)


def _cmd_serve(args: argparse.Namespace) -> int:
    from kog.serve_cli import run

    return run(args)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default ("on"/"off" for switches), unless its text
    already states it; an option whose default is None must state it in words."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        optional = action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE)
        if not optional or "default" in text or action.default in (None, argparse.SUPPRESS):
            return text
        value = ("on" if action.default else "off") if isinstance(action.default, bool) else "%(default)s"
        return f"{text} (default: {value})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kog", description="Kog: LLM inference for AI agents",
                                     formatter_class=DefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=DefaultsHelpFormatter)

    p_info = add("info", "show the native backend, devices and versions")
    p_info.add_argument("--json", action="store_true", help="print JSON instead of text")
    p_info.set_defaults(func=_cmd_info)
    p_conv = add("convert", "write a GGUF model as a Hugging Face folder (safetensors), or a GGUF or HF model as a "
                            "GGUF file (llama.cpp's layout) of a chosen weight type")
    p_conv.add_argument("model", help="a .gguf file, an HF folder, or SmolLM2-135M-Instruct for the default model")
    p_conv.add_argument("out", help="a folder to write config.json, model.safetensors, tokenizer files into, or a "
                                    ".gguf file")
    p_conv.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="HF folder: dtype of the written weights (default: the file's; float32 for quantized "
                             "files)")
    p_conv.add_argument("--outtype", choices=["f32", "f16", "bf16", "q8_0", "q4_k"], default=None,
                        help=".gguf output: type of the weight matrices (default f16; q4_k writes matrices whose "
                             "rows are not a multiple of 256 as q8_0)")
    p_conv.add_argument("--no-progress", action="store_true", help="no progress bar")
    p_conv.set_defaults(func=_cmd_convert)
    p_gen = add("generate", "stream a completion from a model, then report TTFT and tok/s")
    from kog.generate_cli import add_arguments
    from kog.generate_cli import check_arguments as check_generate_arguments

    add_arguments(p_gen)
    p_gen.set_defaults(func=_cmd_generate, check=lambda args: check_generate_arguments(p_gen, args))
    p_serve = add("serve", "serve a model over an OpenAI-compatible HTTP API")
    from kog.serve_cli import add_arguments as add_serve_arguments
    from kog.serve_cli import check_arguments as check_serve_arguments

    add_serve_arguments(p_serve)
    p_serve.set_defaults(func=_cmd_serve, check=lambda args: check_serve_arguments(p_serve, args))
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, except that `kog generate [MODEL] PROMPT` may have options between its two
    positionals (`kog generate m.gguf --max-tokens 8 "Hi"`), which plain parse_args refuses."""
    args, extra = parser.parse_known_args(argv)
    if args.command != "generate":
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return args
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices["generate"].parse_intermixed_args(argv[argv.index("generate") + 1:])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(parser, argv)
    if hasattr(args, "check"):  # checks across flags, after parsing (exits with status 2)
        args.check(args)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
