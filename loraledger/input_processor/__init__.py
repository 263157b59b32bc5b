"""Every check of a request, in one place: the API edge's (check_arguments) and the model's (check_model_inputs).

Both are pure functions of their arguments: no I/O, no engine state. The edge runs when a caller submits (the
engine's copy is frozen there, before the caller can change what it sent); admission runs the model checks once it
has the request's tokenizer, and keeps for itself only what waits on something (tokenizers read from disk, grammar
compilation, the adapter loader, the audit log).
"""

from loraledger.input_processor.arguments import (
    MAX_ID_CHARS,
    EdgeLimits,
    check_abort_ids,
    check_arguments,
    check_audit_ids,
    check_lora_int_id,
    check_lora_request,
)
from loraledger.input_processor.model_inputs import INLINE_TOKENIZE_CHARS, ModelInputs, check_model_inputs, shown_id

__all__ = [
    "INLINE_TOKENIZE_CHARS",
    "MAX_ID_CHARS",
    "EdgeLimits",
    "ModelInputs",
    "check_abort_ids",
    "check_arguments",
    "check_audit_ids",
    "check_lora_int_id",
    "check_lora_request",
    "check_model_inputs",
    "shown_id",
]
