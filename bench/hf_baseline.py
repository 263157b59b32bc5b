"""The reference system: Hugging Face transformers (and PEFT for adapters), greedy, one static batch per call.

fp32 on the CPU for the throughput benchmark; bench.gpu_decode builds it in bf16 on a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch

BASE = "__base__"  # PEFT's adapter_names entry for "no adapter"
PAD_ID = 3


class TokenClock:
    """A generate() streamer that only notes when each batch-wide token step comes out.

    generate() calls put() once with the prompt before the prefill, then once per new token (all
    rows at once), so times[1] is the first token and the gaps after it are the inter-token times.
    """

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFModel:
    """One model instance: plain (base only) or a PeftModel holding every adapter under its index as name."""

    def __init__(
        self, model_dir: Path, adapters: Sequence[Path] = (), *, dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)
        model.eval()
        self.device = torch.device(device)
        self.with_adapters = bool(adapters)
        if adapters:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(adapters[0]), adapter_name="0")
            for i, path in enumerate(adapters[1:], start=1):
                model.load_adapter(str(path), adapter_name=str(i))
            model.eval()
        self.model = model

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        adapter_of: Sequence[int | None],
        new_tokens: int,
        clock: TokenClock | None = None,
    ) -> torch.Tensor:
        """Greedy, exactly `new_tokens` per row (min_new_tokens = max_new_tokens), left padded; returns the new ids."""
        longest = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), longest), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, longest - len(prompt) :] = torch.tensor(prompt)
            mask[row, longest - len(prompt) :] = 1
        kwargs = {}
        if self.with_adapters:
            kwargs["adapter_names"] = [BASE if a is None else str(a) for a in adapter_of]
        elif any(a is not None for a in adapter_of):
            raise ValueError(
                "this HFModel has no adapters; build it with the adapter folders to serve adapter requests"
            )
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=PAD_ID,
                streamer=clock,
                **kwargs,
            )
        return out[:, longest:].cpu()
