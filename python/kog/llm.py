"""kog.LLM: the offline Python API, shaped like vLLM's.

    llm = kog.LLM()                                   # SmolLM2-135M-Instruct on the CPU
    out = llm.generate(["The capital of France is"], kog.SamplingParams(max_tokens=16))
    print(out[0].outputs[0].text)
    llm.chat([{"role": "user", "content": "Hi!"}])
    with llm.session(messages=[...], tools=[...]) as s:   # an agent session (docs/SESSIONS.md)
        s.generate(params); s.append(messages=[...]); s.generate(params)
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any, Iterator, Sequence

import torch

from kog.engine import EngineConfig, LLMEngine, RequestOutput, StreamDelta
from kog.errors import InvalidRequest
from kog.fp8 import gpu_format
from kog.loader import ChatTemplate, Tokenizer, load_config, load_model
from kog.loader.chat_encoding import encode_conversation
from kog.loader.chat_template import read_chat_template
from kog.sampling_params import SamplingParams
from kog.llm_session import Session
from kog.structured_output.params import StructuredOutputParams
from kog.valid_text import check_text

PromptType = str | dict[str, Any]

# KV cache size when none is given: enough for every sequence at full length, at most this much.
DEFAULT_KV_CACHE_GIB = 1.0


class LLM:
    """A model ready to generate.

    Args:
        model: an HF folder, a .gguf file, or None for the default SmolLM2-135M-Instruct.
        dtype: "float32", "bfloat16", "float16" (or "half") or None (bf16 checkpoints run in
            bf16, others in fp32).
        quantization: "fp8" rounds each layer's linear matrices to FP8 e4m3 with one scale per
            output channel at load (kog.fp8); None: as stored. FP8 checkpoints (a
            quantization_config) load either way. On the CPU the FP8 values are dequantized to
            dtype at load; on a GPU they stay FP8 (the decode kernel's FP8 GEMV; prefill
            multiplies dequantized tiles), as do a GGUF's Q4_0 / Q4_1 / Q4_K matrices (its 4-bit
            GEMV) when dtype is None, with bfloat16 activations.
        max_model_len: context length limit (default: the model's).
        max_num_seqs: most sequences decoded together.
        max_num_batched_tokens: token budget of one engine step (chunked prefill size).
        kv_cache_gib: memory for the paged KV cache (default: enough for every sequence at full
            length, at most 1 GiB).
        gpu_memory_utilization: instead of kv_cache_gib, the fraction of the device's memory
            that weights and KV cache may use, as vLLM's (on the CPU: of the host memory
            available once the weights are loaded); see kog.memory_budget.
        block_size: tokens per KV block.
        kv_cache_dtype: the KV cache's dtype. None or "auto": float16 for a GGUF whose quantized
            blocks are kept (float32 activations) on the CPU, as llama.cpp's default
            cache; the run dtype otherwise. Explicitly: the run dtype, or on the CPU "bfloat16" /
            "float16" under float32 activations: half the KV memory and half the bytes each
            decode step's attention reads, keys and values rounded once as they are stored
            (vLLM's kv_cache_dtype).
        progress: progress bar while loading (None: when stderr is a TTY).
        swap_space_gib: host memory for swapped-out KV (suspended sessions, preempted
            sequences); 0 disables swapping.
        enable_prefix_caching: reuse the KV of cached prompt prefixes across requests.
        device: "cpu", or "cuda" to run on a GPU (ROCm devices are "cuda" in torch too): decode
            through the persistent decode kernel, prefill through the GPU ops; needs a GPU
            build of kog (KOG_BACKEND=cuda or rocm).
        speculative_model: a small model with the same tokenizer that drafts tokens for
            requests with `SamplingParams(speculative={"method": "draft"})` (None: only n-gram
            drafting is available).
        chat_template: a Jinja chat template, or the path of a file holding one, used instead of
            the model's (vLLM's --chat-template). With the model's own template, a ChatML model
            whose template ignores `tools` renders requests with tools through Kog's Hermes tool
            template (kog/templates/hermes_tools.jinja).
        allow_special_tokens_in_content: tokenize control-token text in messages and tools
            (`<|im_end|>` in a tool result) as the control token. Off by default: untrusted text
            must not be able to end a turn or open a system one.
        tensor_parallel_size: ranks to split the model over (kog.parallel): ranks 1 .. N-1 run as
            processes on this host, each with its share of the heads, MLP units (or Laneformer
            lanes) and KV heads; N must divide the KV heads (Laneformer: the lanes). Float weights
            or a GGUF's blocks. On the CPU, ranks on one host decode natively (the multi-token loop
            included), across hosts through the program interpreter. With device="cuda", rank r
            runs on its host's GPU r % (N / nnodes): the program's collectives go through NCCL
            (RCCL on ROCm), and decode through every rank's persistent kernel, which exchange
            the collectives by peer-memory stores (kog.parallel.gpu_peers), where the kernel runs
            the program (not yet: quantized weights, which go through the interpreter).
        nnodes, master_addr, master_port: ranks over several hosts (this one is host 0 and runs
            rank 0; every other host runs `python -m kog.parallel.worker --size N --nnodes H
            --node-rank K --addr MASTER_ADDR --port MASTER_PORT`, or `kog serve ... --node-rank K`).
            Across hosts the collectives go through gloo and decode through the interpreter.
    """

    def __init__(self, model: str | os.PathLike[str] | None = None, dtype: str | torch.dtype | None = None, *,
                 max_model_len: int | None = None, max_num_seqs: int = 16, max_num_batched_tokens: int = 512,
                 kv_cache_gib: float | None = None, block_size: int = 16, progress: bool | None = None,
                 swap_space_gib: float = 0.0, enable_prefix_caching: bool = True,
                 device: str = "cpu", speculative_model: str | os.PathLike[str] | None = None,
                 gpu_memory_utilization: float | None = None, chat_template: str | None = None,
                 allow_special_tokens_in_content: bool = False, quantization: str | None = None,
                 tensor_parallel_size: int = 1, nnodes: int = 1, master_addr: str | None = None,
                 master_port: int | None = None, kv_cache_dtype: str | None = None) -> None:
        from kog.kvcache import KVLayout
        from kog.models.runner import ModelRunner, kv_cache_dtype_for

        if kv_cache_gib is not None and gpu_memory_utilization is not None:
            raise InvalidRequest("give kv_cache_gib or gpu_memory_utilization, not both")
        template_source = read_chat_template(chat_template) if chat_template is not None else None
        on_gpu = str(device) != "cpu"
        if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise InvalidRequest(f"tensor_parallel_size must be an int >= 1, got {tensor_parallel_size!r}")
        if tensor_parallel_size > 1:  # a device this host cannot give every rank fails before any weight is read
            from kog.parallel.ranks import Placement, check_devices

            check_devices(device, tensor_parallel_size, Placement(nnodes, 0))
        kv_dtype = _kv_cache_dtype(kv_cache_dtype)
        if tensor_parallel_size > 1 and quantization is not None:
            # NOTE: per-output-channel scales of a rank's columns are not the whole rows' scales
            raise InvalidRequest(f"quantization={quantization!r} with tensor_parallel_size > 1 is not supported "
                                 "(load the checkpoint as stored, or quantize it first: kog convert)")
        shard = None
        if tensor_parallel_size > 1:  # this process is rank 0: it reads only its share of the weights
            from kog.parallel.ranks import rank_view

            shard = rank_view(0, tensor_parallel_size)
        loaded = load_model(model, dtype, progress, template_source, quantization=quantization, device=device,
                            fp8_format=gpu_format() if on_gpu else None, shard=shard)
        if loaded.chat_template is not None:
            loaded.chat_template.allow_special_tokens_in_content = allow_special_tokens_in_content
        cfg = loaded.config  # rank 0's view under tensor parallelism: its KV heads
        context = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if kv_dtype is None and not on_gpu:  # "auto"
            kv_dtype = default_kv_cache_dtype(loaded)
        # refused before the KV is sized (device: its kind only; the runner checks the device itself)
        kv_dtype = kv_cache_dtype_for(loaded.dtype, kv_dtype, torch.device("cuda" if on_gpu else "cpu"))
        layout = KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size, kv_dtype)
        num_blocks = _num_kv_blocks(layout.bytes_per_block, max_num_seqs * -(-context // block_size), kv_cache_gib,
                                    gpu_memory_utilization, device, loaded.weights)
        if swap_space_gib < 0:
            raise InvalidRequest(f"swap_space_gib must be >= 0, got {swap_space_gib}")
        num_host_blocks = int(swap_space_gib * 2**30) // layout.bytes_per_block
        if tensor_parallel_size > 1:
            from kog.parallel.ranks import RankSpec, start_ranks

            dtype_name = str(dtype).removeprefix("torch.") if dtype is not None else None
            runner = start_ranks(RankSpec(None if model is None else str(model), dtype_name, tensor_parallel_size,
                                          num_blocks, block_size, num_host_blocks,
                                          max_rows=max(max_num_seqs, 32), device=device,
                                          kv_cache_dtype=str(kv_dtype).removeprefix("torch.")),
                                 loaded,
                                 Placement(nnodes, 0, master_addr or "127.0.0.1", master_port))
        else:
            runner = ModelRunner(loaded, num_kv_blocks=num_blocks, block_size=block_size,
                                 num_host_blocks=num_host_blocks, device=device, kv_cache_dtype=kv_dtype)
        engine = LLMEngine(runner, loaded.tokenizer, loaded.stop_token_ids, context,
                           EngineConfig(max_num_seqs, max_num_batched_tokens, context, num_host_blocks,
                                        str(loaded.path), enable_prefix_caching))
        self._init(engine, loaded.tokenizer, loaded.chat_template)
        # NOTE: the runner holds its own (prepared, possibly huge-page) copy of the weights;
        # the loader's are released so that the model is in memory once.
        self.model = dataclasses.replace(loaded, weights={}, config=load_config(loaded.path) if shard else cfg)
        if speculative_model is not None:
            from kog.engine.draft import load_draft_model

            load_draft_model(engine, speculative_model, loaded.dtype, context, block_size, max_num_seqs, progress)

    @classmethod
    def from_engine(cls, engine: LLMEngine, tokenizer: Tokenizer, chat_template: ChatTemplate | None = None) -> LLM:
        """Wraps an existing engine (tests, custom runners)."""
        llm = cls.__new__(cls)
        llm._init(engine, tokenizer, chat_template)
        llm.model = None
        return llm

    def _init(self, engine: LLMEngine, tokenizer: Tokenizer, chat_template: ChatTemplate | None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._ids = itertools.count()
        self._session_ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generates for every prompt, batched; returns one RequestOutput per prompt, in order.

        A prompt is a string or {"prompt_token_ids": [...]} (or {"prompt": "..."}).
        """
        items = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        check_text(items, "prompts")
        params = self._params_list(sampling_params, len(items))
        ids = [self._add(item, p) for item, p in zip(items, params)]
        return self.run(ids)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None, tool_choice: str | dict[str, Any] | None = None,
             parallel_tool_calls: bool = True) -> list[RequestOutput]:
        """Renders each conversation with the model's chat template, then generates.

        Args:
            tool_choice: None leaves the output free; "auto", "required" or
                `{"type": "function", "function": {"name": ...}}` constrain it to the tools' calls
                (OpenAI's meaning; see StructuredOutputParams.from_openai). "none": free.
            parallel_tool_calls: False allows one call per reply.
        """
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.encode_chat(c, tools, add_generation_prompt, chat_template_kwargs)}
                   for c in convs]
        if tool_choice is not None:
            sampling_params = _with_tools(self._params_list(sampling_params, len(prompts)), tools, tool_choice,
                                          parallel_tool_calls)
        return self.generate(prompts, sampling_params)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yields the request's deltas as the engine produces them."""
        rid = self._add(prompt, sampling_params or SamplingParams())
        try:
            while not self.engine.get_output(rid).finished:
                for d in self.engine.step():
                    if d.request_id == rid:
                        yield d
        finally:
            self.engine.release(rid)

    def session(self, messages: list[dict[str, Any]] | None = None, tools: list[dict[str, Any]] | None = None,
                prompt_token_ids: Sequence[int] | None = None, pin: bool = True,
                chat_template_kwargs: dict[str, Any] | None = None) -> Session:
        """Opens an agent session: its prefix is prefilled once (before this returns) and pinned.

        Args:
            messages: the opening conversation (system prompt...), rendered with the chat
                template and tools; the session is then in chat mode.
            tools: tool schemas for the template.
            prompt_token_ids: the prefix as token ids instead of messages.
            pin: keep the prefix's KV resident in the prefix cache while the session lives.
            chat_template_kwargs: extra template variables.
        Returns:
            the Session (a context manager; close() frees its KV).
        """
        if (messages is None) == (prompt_token_ids is None):
            raise InvalidRequest("session: pass exactly one of messages or prompt_token_ids")
        ids = (list(prompt_token_ids) if prompt_token_ids is not None
               else self.encode_chat(messages, tools, True, chat_template_kwargs))
        sid = self.new_session_id()
        rid = self.engine.sessions.open(sid, ids, pin)
        try:
            opened = self.run([rid])[0]
        except BaseException:
            self.engine.sessions.close(sid)
            raise
        session = Session(self, sid, messages, tools, chat_template_kwargs)
        session.opened = opened
        return session

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The prompt tokens of a conversation: the chat template's render, with control-token
        text inside messages and tools tokenized as plain text (kog.loader.chat_encoding).

        Raises:
            InvalidRequest: no chat template, a lone surrogate in a message (named), or the
                template refused the conversation.
        """
        if self.chat_template is None:
            raise InvalidRequest("this model has no chat template; use generate() with a plain prompt")
        return encode_conversation(self.chat_template, self.tokenizer, messages, tools, add_generation_prompt,
                                   **(chat_template_kwargs or {}))

    def run(self, request_ids: list[str]) -> list[RequestOutput]:
        """Steps the engine until every request of request_ids is finished (others queued in the
        engine advance too), then releases them.

        Returns:
            their final outputs, in the order of request_ids.
        """
        try:
            while any(not self.engine.get_output(r).finished for r in request_ids):
                self.engine.step()
            return [self.engine.get_output(r) for r in request_ids]
        finally:
            for r in request_ids:
                self.engine.release(r)

    def new_request_id(self) -> str:
        """A request id this LLM never gave before: for run(), and for requests added to self.engine directly."""
        return str(next(self._ids))

    def new_session_id(self) -> str:
        """A session id this LLM never gave before (engine.sessions.open, fork)."""
        return f"session-{next(self._session_ids)}"

    # ---- internal helpers ---------------------------------------------------------------------
    @staticmethod
    def _params_list(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise InvalidRequest(f"got {len(params)} sampling params for {n} prompts")
        return params

    def _add(self, prompt: PromptType, params: SamplingParams) -> str:
        text: str | None = None
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
            if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise InvalidRequest("prompt_token_ids must be a list of integers")
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            text, ids = prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        else:
            raise InvalidRequest(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        rid = self.new_request_id()
        self.engine.add_request(rid, ids, params, prompt=text)
        return rid

def default_kv_cache_dtype(loaded) -> torch.dtype | None:
    """kv_cache_dtype None / "auto" on the CPU: float16 for a model whose quantized blocks are kept
    (a GGUF run with float32 activations), as llama.cpp's default cache; else None (the run
    dtype). Measured: half the KV bytes, SmolLM2 Q4_1 decode 1.2x at 2k and 1.4x at 8k tokens of
    context, greedy tokens equal to the float32 cache's (docs/PERFORMANCE.md)."""
    from kog.quantized import QuantizedWeight

    if loaded.dtype == torch.float32 and any(isinstance(w, QuantizedWeight) for w in loaded.weights.values()):
        return torch.float16
    return None


def _kv_cache_dtype(name: str | None) -> torch.dtype | None:
    """LLM's kv_cache_dtype argument as a torch dtype (None: the run dtype)."""
    from kog.loader.weights import RUN_DTYPES

    if name is None or name == "auto":
        return None
    if not isinstance(name, str) or name not in RUN_DTYPES:
        raise InvalidRequest(f"kv_cache_dtype must be 'auto' or one of {sorted(RUN_DTYPES)}, got {name!r}")
    return RUN_DTYPES[name]


def _num_kv_blocks(bytes_per_block: int, wanted: int, kv_cache_gib: float | None,
                   gpu_memory_utilization: float | None, device: str, weights: dict[str, torch.Tensor]) -> int:
    """KV blocks: kv_cache_gib's worth, or gpu_memory_utilization's (kog.memory_budget), or by
    default enough for `wanted` blocks (every sequence at full length) within DEFAULT_KV_CACHE_GIB."""
    from kog.memory_budget import device_memory, kv_cache_bytes

    if gpu_memory_utilization is not None:
        on_gpu = str(device).startswith("cuda")
        if on_gpu:
            from kog.info import gpu_unavailable_reason

            if (reason := gpu_unavailable_reason()) is not None:
                raise InvalidRequest(f"device {device!r}: {reason}")
        weight_bytes = sum(w.nbytes for w in weights.values()) if on_gpu else 0
        memory = device_memory(device if on_gpu else "cpu")
        return max(2, kv_cache_bytes(gpu_memory_utilization, memory, weight_bytes) // bytes_per_block)
    budget = int((kv_cache_gib or DEFAULT_KV_CACHE_GIB) * 2**30) // bytes_per_block
    return max(2, budget if kv_cache_gib else min(wanted, budget))


def _with_tools(params: list[SamplingParams], tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any],
                parallel_tool_calls: bool) -> list[SamplingParams]:
    """Copies of params whose output is constrained to the tool calls tool_choice asks for."""
    if not tools and tool_choice != "none":
        raise InvalidRequest(f"tool_choice {tool_choice!r} needs tools")
    structured = StructuredOutputParams.from_openai(None, tools, tool_choice, parallel_tool_calls)
    if structured is None:
        return params
    if any(p.structured is not None for p in params):
        raise InvalidRequest("tool_choice constrains the output: leave SamplingParams.structured unset")
    return [dataclasses.replace(p, structured=structured) for p in params]
