"""`kog serve`: the OpenAI-compatible server (flag names and meanings follow `vllm serve`).

SIGTERM drains: new requests get 503 (and /health turns 503) while the requests in flight
finish, then the process exits 0. A second SIGTERM, or SIGINT, stops at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`kog serve`'s flags."""
    p.add_argument("model", nargs="?", default=None,
                   help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("KOG_API_KEY"),
                   help="require `Authorization: Bearer <key>` on /v1/* (default: $KOG_API_KEY, else none)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; the first is reported (default: the model's file name)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="most sequences running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one engine step")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="run dtype")
    p.add_argument("--device", default="cpu",
                   help="cpu (default), or cuda / cuda:N for a GPU build of kog (ROCm GPUs are cuda too)")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="memory for the paged KV cache (default: enough for every sequence, at most 1 GiB)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of cached prompt prefixes across requests (default: on)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="most requests queued and not yet running; more get 429 with Retry-After")
    p.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="largest request body (413 above)")
    p.add_argument("--tool-call-parser", choices=["auto", "hermes", "llama3_json"], default="auto",
                   help="how tool calls are read from the model's text")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility; tool calls are always parsed when a request has tools")
    p.add_argument("--speculative-model", default=None, metavar="PATH",
                   help="a small model with the model's tokenizer that drafts tokens (speculative method 'draft')")
    p.add_argument("--speculative", type=speculative_spec, default=None, metavar="METHOD[:K]",
                   help="speculative decoding for requests that do not set `speculative`: METHOD ngram or draft "
                        "(draft needs --speculative-model), K draft tokens per step (default 4); default: off")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds in-flight requests may take after SIGTERM")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])


def speculative_spec(text: str):
    """`--speculative METHOD[:K]` as kog.spec.SpeculativeParams (argparse type)."""
    from kog.errors import InvalidRequest
    from kog.spec.params import SpeculativeParams

    method, colon, k = text.partition(":")
    try:
        return SpeculativeParams(method=method, num_tokens=int(k) if colon else 4)
    except (ValueError, InvalidRequest) as e:
        raise argparse.ArgumentTypeError(f"{text!r}: expected ngram[:K] or draft[:K] with 1 <= K <= 16 ({e})") from None


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks between flags argparse cannot express; exits through parser.error (status 2)."""
    if args.speculative is not None and args.speculative.method == "draft" and args.speculative_model is None:
        parser.error("--speculative draft needs --speculative-model PATH (a draft model)")


def run(args: argparse.Namespace) -> int:
    """Loads the model and serves until SIGTERM/SIGINT. Returns the exit status (1: bad model)."""
    from kog.errors import KogError

    try:
        return _serve(args)
    except KogError as e:
        print(f"kog serve: {e}", file=sys.stderr)
        return 1


def load_llm(args: argparse.Namespace):
    """The engine `kog serve` serves, as its flags describe (kog.LLM; KogError on a bad model)."""
    from kog.llm import LLM

    return LLM(args.model, None if args.dtype == "auto" else args.dtype, max_model_len=args.max_model_len,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               kv_cache_gib=args.kv_cache_gib, block_size=args.block_size,
               enable_prefix_caching=args.enable_prefix_caching, progress=False,
               speculative_model=args.speculative_model, device=args.device)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kog.engine.async_engine import AsyncEngine
    from kog.server import ServerConfig, build_app
    from kog.server.draining import DrainingServer

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    llm = load_llm(args)
    names = args.served_model_name or [llm.model.path.stem if llm.model.path.suffix else llm.model.path.name]
    engine = AsyncEngine(llm.engine, max_waiting=args.max_waiting)
    config = ServerConfig(served_model_names=names, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                          tool_call_parser=args.tool_call_parser, drain_timeout_s=args.drain_timeout,
                          speculative=args.speculative)
    app = build_app(engine, llm.tokenizer, llm.chat_template, config)
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                               timeout_graceful_shutdown=int(args.drain_timeout) + 1)
    server = DrainingServer(uv_config, engine, args.drain_timeout)
    print(f"kog serve: {names[0]} (context {llm.engine.max_model_len}) on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    server.run()
    return 0

