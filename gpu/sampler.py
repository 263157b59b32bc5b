"""Sampler: batched token choice (token controls, penalties, temperature, top-k/p, min-p) with batch-independent seeded noise.

Logits are processed in vLLM's order: allowed_token_ids, bad_words, min_tokens and logit_bias, then
the penalties, then temperature, top-k, top-p and min-p. Logprobs (and ranks) are always those of
the raw logits (vLLM's default logprobs mode); for a row under a grammar, the logits the sampler gets
are already masked by it, so its logprobs are those of the constrained distribution.

Random rows use the Gumbel-max race `argmax(logits / T + G)`, where the noise G of vocabulary entry v
is a pure function of (sequence seed, output position, v). A seeded sequence therefore picks the same
tokens however it is batched, preempted or recomputed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraledger.gpu.argmax_cpu_kernel import argmax
from loraledger.gpu.transfer import to_device
from loraledger.scheduling.step_plan import SamplingSpec

_GREEDY_BELOW = 1e-5
_MASK32 = 0xFFFFFFFF


@dataclass
class SampleRow:
    """What the sampler needs of one row: its settings and the sequence's token history.

    num_output: how many tokens the sequence has sampled before this one (the draw's position);
    None means len(output_token_ids). With overlapped steps the last one may still be on the device:
    the count is then ahead of the ids, which only the penalties read (rows that need them must be
    given their whole history: SamplingSpec.needs_history).
    """

    spec: SamplingSpec
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens sampled so far
    num_output: int | None = None
    constrained: bool = False  # a grammar masked this row's logits already; its end, not min_tokens, decides on EOS

    @property
    def position(self) -> int:
        return len(self.output_token_ids) if self.num_output is None else self.num_output


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # log_softmax of the raw logits at the chosen token
    top_logprobs: list[list[tuple[int, float]] | None]  # best first, per row; None where not asked
    ranks: list[int | None] | None = None  # the chosen token's rank in the raw logits (1: best); None where not asked


class SampleJob:
    """One batch's draws, still on the device: `tokens` feeds the next step without a host round trip;
    result() reads everything back in one copy (waiting for the device with the GIL released)."""

    def __init__(
        self,
        tokens: torch.Tensor,
        chosen: torch.Tensor,
        top: tuple[torch.Tensor, torch.Tensor] | None,
        top_ks: list[int],
        ranks: torch.Tensor | None = None,
    ) -> None:
        self.tokens = tokens  # [N] int64
        self._top_ks = top_ks  # per row: -1 none, k >= 0 the top k
        n = tokens.shape[0]
        parts = [tokens.double(), chosen.double()]
        self._has_ranks = ranks is not None
        if ranks is not None:
            parts.append(ranks.double())
        if top is not None:
            parts += [top[0].double().flatten(), top[1].double().flatten()]
        packed = torch.cat(parts) if n else tokens.new_zeros(0, dtype=torch.float64)
        self._width = 0 if top is None else top[0].shape[1]
        self._event = None
        if packed.is_cuda:
            # one device-to-host copy into pinned memory, ordered after the step's kernels
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(packed.device))
            packed = host
        self._packed = packed
        self._result: SamplerOutput | None = None

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def result(self) -> SamplerOutput:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()  # releases the GIL while the device works
            flat = self._packed.tolist()
            n, w = self.tokens.shape[0], self._width
            tokens = [int(t) for t in flat[:n]]
            chosen = flat[n : 2 * n]
            at = 2 * n
            ranks = None
            if self._has_ranks:
                ranks = [int(r) if k >= 0 else None for r, k in zip(flat[at : at + n], self._top_ks)]
                at += n
            top: list[list[tuple[int, float]] | None] = [None] * n
            if w:
                vals, ids = flat[at : at + n * w], flat[at + n * w :]
                for i, k in enumerate(self._top_ks):
                    if k >= 0:
                        top[i] = [(int(ids[i * w + j]), vals[i * w + j]) for j in range(min(k, w))]
            else:
                top = [[] if k == 0 else None for k in self._top_ks]
            self._result = SamplerOutput(tokens, chosen, top, ranks)
        return self._result


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        vocab = torch.arange(vocab_size, dtype=torch.int64, device=self.device)
        self._vocab_hash = _hash32(_mul32(vocab, 0x9E3779B1) ^ 0x5BD1E995)

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SamplerOutput:
        """Choose one token per row of `logits` [N, V] (fp32, raw model output)."""
        return self.sample_async(logits, rows).result()

    def sample_async(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleJob:
        """sample(), with the choices left on the device until SampleJob.result() asks for them."""
        n = len(rows)
        logits = logits.float()
        specs = [r.spec for r in rows]
        if n == 0:
            empty = torch.zeros(0, dtype=torch.int64, device=logits.device)
            return SampleJob(empty, empty.float(), None, [])
        processed = self._control_tokens(logits, rows, specs)
        processed = self._hold_stop_tokens(processed, rows, specs)
        processed = self._apply_penalties(processed, rows, specs)
        temps = [s.temperature for s in specs]
        random_rows = [i for i, t in enumerate(temps) if t >= _GREEDY_BELOW]
        tokens = argmax(processed)  # torch's argmax, or the CPU kernel that gives the same index faster
        if random_rows:
            idx = to_device(random_rows, torch.int64, logits.device)
            tokens[idx] = self._sample_random(processed.index_select(0, idx), [rows[i] for i in random_rows])
        # one fused pass over the row (on the CPU about half the time of logsumexp's composite of four)
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.gather(1, tokens[:, None])[:, 0]
        top_ks = [s.logprobs for s in specs]
        top = ranks = None
        k_max = max(top_ks)
        if k_max >= 0:  # vLLM's rank: how many vocabulary entries score at least the chosen one's
            chosen_logit = logits.gather(1, tokens[:, None])[:, 0]
            ranks = (logits >= chosen_logit[:, None]).sum(dim=-1)
        if k_max > 0:  # ordered by the logits themselves: two logits a rounding apart keep their order
            ids = torch.topk(logits, min(k_max, logits.shape[1]), dim=-1).indices
            top = (logprobs.gather(1, ids), ids)
        return SampleJob(tokens, chosen, top, top_ks, ranks)

    def _control_tokens(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], specs: list[SamplingSpec]
    ) -> torch.Tensor:
        """allowed_token_ids, bad_words and logit_bias of the whole batch, as one mask, one bar and one add (vLLM's order).

        A bad word's last token is barred when the sequence's outputs end with the rest of the word (vLLM
        compares with the output tokens only, not the prompt); a one-token word is always barred."""
        which = [i for i, s in enumerate(specs) if s.controls_tokens]
        if not which:
            return logits
        dev, vocab = logits.device, logits.shape[1]
        out = logits.clone()  # the raw logits stay untouched: logprobs are reported from them
        allowed = [i for i in which if specs[i].allowed_token_ids]
        if allowed:
            local = [j for j, i in enumerate(allowed) for _ in specs[i].allowed_token_ids]
            ids = [t for i in allowed for t in specs[i].allowed_token_ids]
            keep = torch.zeros((len(allowed), vocab), dtype=torch.bool, device=dev)
            keep[to_device(local, torch.int64, dev), to_device(ids, torch.int64, dev)] = True
            idx = to_device(allowed, torch.int64, dev)
            out[idx] = out.index_select(0, idx).masked_fill(~keep, float("-inf"))
        barred = []
        for i in which:
            past = rows[i].output_token_ids
            for word in specs[i].bad_words:
                prefix = len(word) - 1
                if prefix > len(past):
                    continue
                if prefix == 0 or list(past[len(past) - prefix :]) == word[:-1]:
                    barred.append((i, word[-1]))
        if barred:
            pairs = to_device(barred, torch.int64, dev)
            out[pairs[:, 0], pairs[:, 1]] = float("-inf")
        biased = [i for i in which if specs[i].bias_token_ids]
        if biased:
            bias_rows = to_device([i for i in biased for _ in specs[i].bias_token_ids], torch.int64, dev)
            bias_ids = to_device([t for i in biased for t in specs[i].bias_token_ids], torch.int64, dev)
            bias_values = to_device([v for i in biased for v in specs[i].bias_values], torch.float32, dev)
            out.index_put_((bias_rows, bias_ids), bias_values, accumulate=True)
        return out

    def _apply_penalties(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], specs: list[SamplingSpec]
    ) -> torch.Tensor:
        need = [
            i
            for i, s in enumerate(specs)
            if s.repetition_penalty != 1.0 or s.presence_penalty != 0.0 or s.frequency_penalty != 0.0
        ]
        if not need:
            return logits
        dev, vocab = logits.device, logits.shape[1]
        idx = to_device(need, torch.int64, dev)
        sub = logits.index_select(0, idx)
        out_counts = _token_counts([rows[i].output_token_ids for i in need], vocab, dev)
        rep = to_device([specs[i].repetition_penalty for i in need], torch.float32, dev)[:, None]
        if any(specs[i].repetition_penalty != 1.0 for i in need):
            # HF semantics: every token of prompt and output, divided if positive, multiplied if negative
            seen = (out_counts > 0) | (_token_counts([rows[i].prompt_token_ids for i in need], vocab, dev) > 0)
            penalised = torch.where(sub > 0, sub / rep, sub * rep)
            sub = torch.where(seen, penalised, sub)
        freq = to_device([specs[i].frequency_penalty for i in need], torch.float32, dev)[:, None]
        pres = to_device([specs[i].presence_penalty for i in need], torch.float32, dev)[:, None]
        sub = sub - freq * out_counts - pres * (out_counts > 0).float()
        processed = logits.clone()
        processed[idx] = sub
        return processed

    def _hold_stop_tokens(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], specs: list[SamplingSpec]
    ) -> torch.Tensor:
        """min_tokens: until a sequence has that many outputs, EOS and its stop token ids cannot be chosen (as in vLLM)."""
        pairs = [
            (i, t)
            for i, (r, s) in enumerate(zip(rows, specs))
            if s.min_tokens > 0 and r.position < s.min_tokens and not r.constrained
            for t in s.stop_ids
            if 0 <= t < logits.shape[1]
        ]
        if not pairs:
            return logits
        index = to_device(pairs, torch.int64, logits.device)
        held = logits.clone()  # the raw logits stay untouched: logprobs are reported from them
        held[index[:, 0], index[:, 1]] = float("-inf")
        return held

    def _sample_random(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        dev = logits.device
        specs = [r.spec for r in rows]
        temp = to_device([s.temperature for s in specs], torch.float32, dev)[:, None]
        scaled = logits / temp
        top_k = [s.top_k if 0 < s.top_k < logits.shape[1] else 0 for s in specs]
        if any(top_k):
            k_max = max(top_k)
            kth = torch.topk(scaled, k_max, dim=-1).values
            k_idx = to_device([max(k, 1) - 1 for k in top_k], torch.int64, dev)[:, None]
            threshold = kth.gather(1, k_idx)
            has_k = to_device([k > 0 for k in top_k], torch.bool, dev)[:, None]
            scaled = scaled.masked_fill(has_k & (scaled < threshold), float("-inf"))
        if any(s.top_p < 1.0 for s in specs):
            top_p = to_device([s.top_p for s in specs], torch.float32, dev)[:, None]
            probs_sorted, order = torch.sort(scaled.softmax(dim=-1), dim=-1, descending=True)
            # drop a token once the more likely ones already cover top_p; the most likely always stays
            # rows without top_p must stay untouched even where rounding pushes the cumulative sum past 1
            drop_sorted = ((probs_sorted.cumsum(dim=-1) - probs_sorted) > top_p) & (top_p < 1.0)
            drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
            scaled = scaled.masked_fill(drop, float("-inf"))
        if any(s.min_p > 0.0 for s in specs):
            min_p = to_device([s.min_p for s in specs], torch.float32, dev)[:, None]
            probs = scaled.softmax(dim=-1)
            scaled = scaled.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
        seeds = [s.seed & ((1 << 64) - 1) for s in specs]
        positions = [r.position for r in rows]
        return argmax(scaled + self.gumbel_noise(seeds, positions))

    def gumbel_noise(self, seeds: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """[N, V] fp32 Gumbel noise, each entry a pure function of (seed, position, vocabulary index)."""
        dev = self.device
        lo = to_device([s & _MASK32 for s in seeds], torch.int64, dev)
        hi = to_device([s >> 32 for s in seeds], torch.int64, dev)
        pos = to_device([p & _MASK32 for p in positions], torch.int64, dev)
        key = _hash32(lo ^ _hash32(hi ^ _hash32(pos ^ 0x27D4EB2F)))
        bits = _hash32(key[:, None] ^ self._vocab_hash[None, :])
        uniform = (bits.double() + 0.5) / 4294967296.0  # strictly inside (0, 1)
        return (-torch.log(-torch.log(uniform))).float()


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[n, V] fp32 count of each vocabulary entry in each row's token list."""
    counts = torch.zeros((len(token_lists), vocab), dtype=torch.float32, device=device)
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64)
    total = int(lengths.sum())
    if total:
        flat = to_device(list(itertools.chain.from_iterable(token_lists)), torch.int64, device)
        row = to_device(
            torch.repeat_interleave(torch.arange(len(token_lists)), lengths, output_size=total).numpy(),
            torch.int64,
            device,
        )
        counts.index_put_((row, flat), torch.ones(total, dtype=torch.float32, device=device), accumulate=True)
    return counts


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), split in 16-bit halves so that int64 never overflows."""
    return ((x & 0xFFFF) * c + (((x >> 16) * c) & 0xFFFF) * 65536) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit mixer (Wellons' lowbias32) over int64 tensors holding values in [0, 2**32)."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)
