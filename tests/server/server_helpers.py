"""Server test helpers: the fake model (or a scripted one) behind the app, driven in process
through Starlette's TestClient; no socket, no weights."""

from __future__ import annotations

import time

import numpy as np
import torch

from kog.engine import EngineConfig, LLMEngine
from kog.loader import ChatTemplate
from kog.testing.fake_runner import FakeRunner
from kog.testing.tiny_models import CHATML_TEMPLATE, tiny_tokenizer

TOK = tiny_tokenizer()
TEMPLATE = ChatTemplate(CHATML_TEMPLATE)


class ScriptedRunner(FakeRunner):
    """A fake model that answers every prompt with `script` (token ids) then EOS: the next token
    continues the longest script prefix that ends the context."""

    def __init__(self, script: list[int], eos: int, num_blocks: int = 64, block_size: int = 4) -> None:
        super().__init__(TOK.vocab_size, num_blocks, block_size)
        self.script, self.eos = list(script), eos

    def _logits(self, context: list[int]) -> torch.Tensor:
        k = next((k for k in range(min(len(context), len(self.script)), 0, -1)
                  if context[-k:] == self.script[:k]), 0)
        row = torch.full((self.vocab_size,), -10.0)
        row[self.script[k] if k < len(self.script) else self.eos] = 10.0
        return row

    def prefill(self, chunks) -> torch.Tensor:
        rows = []
        for c in chunks:
            self._write(c.slots, list(c.token_ids))
            rows.append(self._logits(self._read(c.block_table, c.start_pos + len(c.token_ids))))
        return torch.stack(rows)

    def decode(self, tokens, positions, block_tables, seq_lens, slots) -> torch.Tensor:
        self._write(np.asarray(slots), [int(t) for t in tokens])
        return torch.stack([self._logits(self._read(block_tables[i], int(seq_lens[i]))) for i in range(len(tokens))])


def make_engine(runner=None, step_delay: float = 0.0, max_model_len: int = 512, **config) -> LLMEngine:
    engine = LLMEngine(runner or FakeRunner(TOK.vocab_size, 64, 4), TOK, [TOK.eos_token_id], max_model_len,
                       EngineConfig(**config))
    if step_delay:
        step = engine.step

        def slow_step():
            time.sleep(step_delay)
            return step()

        engine.step = slow_step
    return engine
