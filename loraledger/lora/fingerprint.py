"""The adapter fingerprint: the content digest an auditor recomputes to check an adapter on disk.

Fingerprint (version 1)
-----------------------
``frame(b)`` is ``len(b)`` as 8 bytes big-endian followed by the bytes ``b``. The fingerprint
is the lowercase hex SHA-256 of the concatenation of these frames, in this order:

1. ``frame(b"loraledger-adapter-fingerprint/v1")`` -- the algorithm's name and version.
2. ``frame(C)`` where ``C`` is the whole of ``adapter_config.json`` parsed as JSON and
   re-serialized with Python's
   ``json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)``,
   encoded as UTF-8 (so whitespace and key order in the file do not matter, values do).
3. For every tensor of ``adapter_model.safetensors`` (the ``__metadata__`` entry is not a
   tensor and is left out), in ascending order of the tensor name's code points, four frames:
   ``frame(name as UTF-8)``, ``frame(dtype string as in the safetensors header, ASCII,
   e.g. b"BF16")``, ``frame(shape as JSON without spaces, ASCII, e.g. b"[8,4096]"; b"[]"
   for a scalar)``, ``frame(the tensor's raw bytes exactly as stored in the file, i.e. the
   data section slice [begin, end) of its data_offsets)``.

Every field is length-prefixed and every tensor contributes exactly four frames, so the
byte stream parses back to one input only: two different adapters cannot collide by
concatenation. Any changed byte of a config value or of a tensor changes the fingerprint;
the safetensors header layout (its order, padding, metadata) does not. ``adapter_fingerprint``
is the one place it is computed: ``load_lora_checkpoint`` and ``fingerprint_adapter`` (a folder's
fingerprint without loading it, loraledger.lora.checkpoint_reader) both call it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

from loraledger.lora.safetensors_header import RawTensor

FINGERPRINT_TAG = b"loraledger-adapter-fingerprint/v1"


def adapter_fingerprint(config: dict, tensors: Iterable[RawTensor]) -> str:
    """The fingerprint of a parsed adapter_config.json and the weights file's tensors, read and sorted by name."""
    h = hashlib.sha256()

    def frame(data: bytes | bytearray) -> None:
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)

    frame(FINGERPRINT_TAG)
    frame(json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
    for t in tensors:
        frame(t.name.encode("utf-8"))
        frame(t.dtype.encode("ascii", "backslashreplace"))
        frame(json.dumps(list(t.shape), separators=(",", ":")).encode("ascii"))
        frame(t.data)
    return h.hexdigest()
