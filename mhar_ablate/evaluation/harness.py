"""The adapter through which lm-evaluation-harness evaluates a trained decoder of this package.

``RunLM`` is an ``lm_eval`` model (``TemplateLM``, whose encoding rules the harness's own Hugging Face
adapter follows: a context's trailing spaces move to the continuation, the pair is encoded whole and
split, an empty context is the end-of-document token). It answers the harness's three requests:

- ``loglikelihood``: log P(continuation | context), summed over the continuation's tokens, and whether
  greedy decoding would have produced it; batched forwards, longest first, right-padded (the decoder is
  causal, so padding after a sequence changes none of its logits). A context longer than the model's
  ``seq_len`` is cut from the left, as the harness's adapters do.
- ``loglikelihood_rolling``: a whole document's log-likelihood over the harness's disjoint rolling
  windows of ``seq_len`` tokens, the first conditioned on the end-of-document token.
- ``generate_until``: greedy decoding, one token per forward of the last ``seq_len`` tokens, until a
  stop string, the end-of-document token or ``max_gen_toks``. Sampling settings are not used.

Log-probabilities are computed in float32 from the decoder's logits (under the run's autocast on a
GPU, as its validation loss is).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from tqdm import tqdm

from .trained import TrainedRun

log = logging.getLogger(__name__)
DEFAULT_MAX_GEN_TOKS = 256


class RunLM(TemplateLM):
    def __init__(self, run: TrainedRun, batch_size: int = 16, autocast: torch.dtype | None = None,
                 progress: bool = True):
        super().__init__()
        self.run = run
        self.model = run.model
        self.tok = run.tokenizer
        self.max_length = run.cfg.model.seq_len
        self.batch_size = batch_size
        self.autocast_dtype = autocast
        self.progress = progress
        self._device = next(self.model.parameters()).device

    # ------------------------------------------------------------------------------ TemplateLM's hooks
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return list(self.tok.encode(string))

    def tok_decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def get_model_info(self) -> dict[str, Any]:
        """What the harness records as the model in its results' ``config``."""
        return self.run.describe()

    # ------------------------------------------------------------------------------------- the forward
    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self._device.type, dtype=self.autocast_dtype, cache_enabled=False)

    @torch.no_grad()
    def _logits(self, batch: list[list[int]]) -> torch.Tensor:
        """The decoder's logits for right-padded ``batch`` (B, T, vocab), in the forward's dtype."""
        width = max(len(ids) for ids in batch)
        idx = torch.full((len(batch), width), self.eot_token_id, dtype=torch.long)
        for i, ids in enumerate(batch):
            idx[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        with self._autocast():
            return self.model(idx.to(self._device))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``requests``: (cache key, context ids, continuation ids) triples; (log-likelihood, greedy) each."""
        windows = []
        for _, context, continuation in requests:
            if not continuation:
                windows.append(None)
                continue
            # The last seq_len tokens of context + continuation, as input; the continuation's own last
            # seq_len tokens are the most that one forward can score.
            continuation = continuation[-self.max_length:]
            whole = (context + continuation)[-(self.max_length + 1):]
            windows.append((whole[:-1], continuation))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for i, w in enumerate(windows):
            if w is None:
                results[i] = (0.0, True)
        order = sorted((i for i, w in enumerate(windows) if w is not None), key=lambda i: -len(windows[i][0]))
        bar = tqdm(total=len(order), desc="log-likelihoods", disable=disable_tqdm or not self.progress, leave=False)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start: start + self.batch_size]
            logits = self._logits([windows[i][0] for i in chunk])
            for row, i in enumerate(chunk):
                inp, cont = windows[i]
                # Only the positions that predict `cont` go to float32 (a large vocabulary's whole batch would not fit).
                span = F.log_softmax(logits[row, len(inp) - len(cont): len(inp)].float(), dim=-1)
                target = torch.tensor(cont, dtype=torch.long, device=span.device)
                ll = float(span.gather(-1, target[:, None]).sum())
                greedy = bool((span.argmax(-1) == target).all())
                results[i] = (ll, greedy)
                key = requests[i][0]
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, results[i])
            bar.update(len(chunk))
        bar.close()
        return results  # type: ignore[return-value]

    # ---------------------------------------------------------------------------- the other requests
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in tqdm(requests, desc="rolling log-likelihoods", disable=disable_tqdm or not self.progress, leave=False):
            (text,) = req.args
            windows = map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1))
            scored = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows], disable_tqdm=True)
            total = sum(ll for ll, _ in scored)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        warned = False
        for req in tqdm(requests, desc="generating", disable=disable_tqdm or not self.progress, leave=False):
            context, gen_kwargs = req.args
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            if not warned and (gen_kwargs.get("do_sample") or float(gen_kwargs.get("temperature", 0) or 0) > 0):
                log.warning("generate_until decodes greedily; the task's sampling settings are not used")
                warned = True
            ids = self.tok_encode(context) or [self.eot_token_id]
            new: list[int] = []
            text = ""
            for _ in range(max_new):
                nxt = int(self._logits([(ids + new)[-self.max_length:]])[0, -1].argmax())
                if nxt == self.eot_token_id:
                    break
                new.append(nxt)
                text = self.tok_decode(new)
                if any(s and s in text for s in until):
                    break
            for s in until:
                if s:
                    text = text.split(s)[0]
            self.cache_hook.add_partial("generate_until", (context, req.args[1]), text)
            out.append(text)
        return out
