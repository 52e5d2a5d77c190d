"""`kog serve`: the OpenAI-compatible server (flag names and meanings follow `vllm serve`).

SIGTERM drains: new requests get 503 with Retry-After (and /health turns 503) while the requests
in flight finish, then the process exits 0. A second SIGTERM, or SIGINT, stops at once.

The port is bound before the model loads: a busy port fails in a second, not after the load.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`kog serve`'s flags."""
    p.add_argument("model", nargs="?", default=None,
                   help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=os.environ.get("KOG_API_KEY"),
                   help="require `Authorization: Bearer <key>` on /v1/* (default: $KOG_API_KEY, else none)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; the first is reported (default: the model's file name)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="most sequences running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one engine step")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="run dtype; auto: bfloat16 for bf16 checkpoints, else float32 (half is float16)")
    p.add_argument("--device", default="cpu",
                   help="cpu, or cuda / cuda:N for a GPU build of kog (ROCm GPUs are cuda too)")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="fp8: round the linear matrices to FP8 e4m3 with per-channel scales at load "
                        "(default: none, 'as stored')")
    p.add_argument("--kv-cache-dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="KV cache dtype; auto: float16 for a GGUF's kept quantized blocks on the CPU (llama.cpp's "
                        "default), else the run dtype. A float32 run may keep a bfloat16 / float16 cache (CPU): half "
                        "the KV memory and bytes read per step")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-gib", type=float, default=None,
                    help="memory for the paged KV cache (default: enough for every sequence, at most 1 GiB)")
    kv.add_argument("--gpu-memory-utilization", type=fraction, default=None, metavar="FRACTION",
                    help="size the KV cache as vLLM does: weights and KV cache take this fraction of the GPU's "
                         "memory; on the CPU backend, the KV cache takes this fraction of the host memory available "
                         "once the weights are loaded (default: unset, --kv-cache-gib's default applies)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the model over N ranks (processes on this host; CPU)")
    p.add_argument("--nnodes", type=int, default=1, help="hosts the ranks run on (SGLang's flag)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this host's index: 0 serves (rank 0); others only run their ranks")
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR"),
                   help="host 0's address for the rendezvous (default: $MASTER_ADDR, else 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ
                   else None, help="host 0's rendezvous port (default: a free one; needed with --nnodes > 1)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of cached prompt prefixes across requests")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="most requests queued and not yet running; more get 429 with Retry-After")
    p.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="largest request body (413 above)")
    p.add_argument("--tool-call-parser", choices=["auto", "hermes", "llama3_json"], default="auto",
                   help="how tool calls are read from the model's text")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility; tool calls are always parsed when a request has tools")
    add_chat_arguments(p)
    p.add_argument("--speculative-model", default=None, metavar="PATH",
                   help="a small model with the model's tokenizer that drafts tokens (speculative method 'draft'; "
                        "default: none)")
    p.add_argument("--speculative", type=speculative_spec, default=None, metavar="METHOD[:K]",
                   help="speculative decoding for requests that do not set `speculative`: METHOD ngram or draft "
                        "(draft needs --speculative-model), K draft tokens per step (default 4); default: off")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds in-flight requests may take after SIGTERM")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's log level")


DTYPES = ["auto", "float32", "bfloat16", "float16", "half"]


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    """The chat-template and model-code flags `kog serve` and `kog generate` share."""
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template, or a file holding one, used instead of the model's (default: the "
                        "model's; a ChatML model whose template ignores tools gets Kog's Hermes tool template for "
                        "requests with tools)")
    p.add_argument("--allow-special-tokens-in-content", action="store_true",
                   help="tokenize control-token text in messages and tools (<|im_end|> in a tool result) as the "
                        "control token, as Kog did before; unsafe with untrusted text")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM compatibility; means nothing: Kog never runs a model's own code")


def fraction(text: str) -> float:
    """A number in (0, 1] (argparse type of --gpu-memory-utilization)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a fraction in (0, 1], e.g. 0.9")
    return value


def speculative_spec(text: str):
    """`--speculative METHOD[:K]` as kog.speculation.SpeculativeParams (argparse type)."""
    from kog.errors import InvalidRequest
    from kog.speculation.params import SpeculativeParams

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
        if args.node_rank != 0:  # another host of a multi-host split: its ranks, no server
            from kog.parallel.ranks import Placement, run_node

            return run_node(args.tensor_parallel_size, Placement(args.nnodes, args.node_rank,
                                                                  args.master_addr or "127.0.0.1", args.master_port))
        return _serve(args)
    except KogError as e:
        print(f"kog serve: {e}", file=sys.stderr)
        return 1


def load_llm(args: argparse.Namespace):
    """The engine `kog serve` serves, as its flags describe (kog.LLM; KogError on a bad model)."""
    from kog.llm import LLM

    return LLM(args.model, None if args.dtype == "auto" else args.dtype, max_model_len=args.max_model_len,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               kv_cache_gib=args.kv_cache_gib, gpu_memory_utilization=args.gpu_memory_utilization,
               block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching, progress=False,
               speculative_model=args.speculative_model, device=args.device, chat_template=args.chat_template,
               allow_special_tokens_in_content=args.allow_special_tokens_in_content,
               quantization=args.quantization, tensor_parallel_size=args.tensor_parallel_size, nnodes=args.nnodes,
               master_addr=args.master_addr, master_port=args.master_port, kv_cache_dtype=args.kv_cache_dtype)


def bind_port(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), not listening yet (uvicorn listens once the app is up:
    until then connections are refused rather than left waiting).

    Raises:
        OSError: the address is in use, or cannot be bound here.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restarts reuse TIME_WAIT ports
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        sock = bind_port(args.host, args.port)
    except OSError as e:
        print(f"kog serve: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    try:
        return _serve_on(sock, args)
    finally:
        sock.close()


def _serve_on(sock: socket.socket, args: argparse.Namespace) -> int:
    import uvicorn

    from kog.engine.async_engine import AsyncEngine
    from kog.server import ServerConfig, build_app
    from kog.server.draining import DrainingServer

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
    server.run(sockets=[sock])
    if server.failed is not None:
        print(f"kog serve: a tensor-parallel rank failed: {server.failed}", file=sys.stderr, flush=True)
        return 1
    return 0

