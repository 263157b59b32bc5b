"""Typed errors: every bad input raises a subclass of LoraLedgerError that says what was wrong and what to do."""

from __future__ import annotations


class LoraLedgerError(Exception):
    """Base class of every error loraledger raises on purpose."""


class ConfigError(LoraLedgerError, ValueError):
    """An engine argument is out of range or inconsistent."""


class ModelLoadError(LoraLedgerError):
    """The base model folder cannot be loaded (missing files, unsupported architecture, bad weights)."""


class QuantizationError(ModelLoadError, ValueError):
    """A checkpoint's quantization is one the engine does not run, is inconsistent with its tensors, or disagrees with
    the quantization= the caller asked for; the message names what is supported."""


class EngineStartError(ModelLoadError):
    """The engine did not start within EngineArgs.start_timeout (a model file that never finishes reading, say)."""


class RemoteCodeError(ModelLoadError):
    """The checkpoint needs the model code it ships (config.json auto_map); loraledger never runs such code."""


class AdapterError(LoraLedgerError):
    """Base class of adapter problems; carries the adapter name and path."""

    def __init__(self, message: str, *, lora_name: str | None = None, lora_path: str | None = None):
        where = ""
        if lora_name is not None or lora_path is not None:
            where = f" (adapter {lora_name!r} at {lora_path!r})"
        super().__init__(message + where)
        self.lora_name = lora_name
        self.lora_path = lora_path


class AdapterNotFoundError(AdapterError):
    """The adapter folder or its adapter_config.json / adapter_model.safetensors is missing."""


class AdapterFormatError(AdapterError):
    """adapter_config.json or the safetensors file is unreadable or corrupt."""


class AdapterRankError(AdapterError):
    """The adapter's rank is above the engine's max_lora_rank."""


class AdapterTargetError(AdapterError):
    """The adapter targets a module the engine cannot apply LoRA to."""


class AdapterShapeError(AdapterError):
    """The adapter's tensors do not match the base model's shapes."""


class AdapterUnsupportedError(AdapterError):
    """The adapter uses a PEFT feature that is not supported yet (DoRA, modules_to_save, bias)."""


class AdapterChangedError(AdapterError):
    """The adapter's content on disk no longer matches the fingerprint a request is bound to."""


class LoRARequestConflictError(LoraLedgerError, ValueError):
    """A lora_int_id or lora_name was reused with a different path."""


class LoRADisabledError(LoraLedgerError, ValueError):
    """A lora_request was given to an engine built with enable_lora=False."""


class TooManyLoRAsError(LoraLedgerError):
    """More adapters are pinned than the engine has device slots."""


class PromptError(LoraLedgerError, ValueError):
    """The prompt is empty, malformed or has token ids outside the vocabulary."""


class PromptTooLongError(PromptError):
    """The prompt (plus the tokens to generate) does not fit max_model_len."""


class ChatTemplateError(PromptError):
    """A chat conversation cannot be rendered: no chat template, a malformed message, or the template refused it."""


class NoTokenizerError(PromptError):
    """The request needs a tokenizer (a text prompt, stop strings, bad_words) but the engine has none (skip_tokenizer_init)."""


class SamplingParamsError(LoraLedgerError, ValueError):
    """A sampling value is out of range. `parameter` names the SamplingParams field when one is to blame (vLLM's
    VLLMValidationError.parameter; the HTTP server's error `param`)."""

    parameter: str | None = None

    def naming(self, parameter: str) -> SamplingParamsError:
        self.parameter = parameter
        return self


class StructuredOutputError(SamplingParamsError):
    """A structured-outputs constraint is malformed, or its grammar does not compile (the message names the problem)."""


class DuplicateRequestError(LoraLedgerError, ValueError):
    """The request id is held by a request that has not finished (vLLM's rule: an id may be reused once its request
    has finished or been aborted; the audit log keys every request with an id of its own)."""


class RequestIdError(LoraLedgerError, ValueError):
    """The request id is not a usable key: not a str, empty, too long, not valid Unicode, or holding NUL."""


class TenantError(LoraLedgerError, ValueError):
    """The tenant is neither None nor a usable str (too long, not valid Unicode)."""


class UnknownRequestError(LoraLedgerError, KeyError):
    """No request with that id is known."""


class AmbiguousRequestIdError(LoraLedgerError, ValueError):
    """A request id prefix matches more than one request; the message lists them."""


class EngineDeadError(LoraLedgerError, RuntimeError):
    """The engine has stopped (shut down, or a fatal error); the request cannot be served."""


class RequestFailedError(LoraLedgerError, RuntimeError):
    """The engine failed while serving this request; the failure is on record in the audit log."""


class AuditUnavailableError(LoraLedgerError, RuntimeError):
    """The audit store cannot be written; with audit_on_failure='reject' new requests are refused."""


class AuditSchemaError(LoraLedgerError, RuntimeError):
    """The audit database's schema is behind head or its append-only guards are missing."""


class DeviceError(LoraLedgerError, RuntimeError):
    """The requested device cannot be used (no GPU, CuPy missing, ...); the message names the fix."""


class KernelInputError(LoraLedgerError, ValueError):
    """A kernel wrapper was given tensors of the wrong shape, stride, dtype or device."""


class LoRARequestError(LoraLedgerError, ValueError):
    """A LoRARequest field is malformed (empty name, id < 1, no path)."""


class AuditIntegrityError(LoraLedgerError, RuntimeError):
    """The audit database refused a record (a guard, a constraint, or a value it cannot hold); nothing of its batch was written."""


class AuditCorruptError(LoraLedgerError, RuntimeError):
    """The audit log holds a row that cannot be read (edited behind the guards, or damaged); `loraledger audit verify` names it."""


class RequestErasedError(AuditIntegrityError):
    """A request whose text `audit erase` removed cannot be resumed or get new kept text."""


class InstanceLeaseLostError(AuditIntegrityError):
    """This engine's lease in a shared audit database expired and another instance recovered it: it may write nothing more."""


class DemoFetchError(LoraLedgerError, RuntimeError):
    """The demo's model could not be had: not fetched from the package index (offline, pip failed, not the pinned
    bytes), or another demo's build of it held the cache folder past the deadline."""


class EvidenceError(LoraLedgerError, ValueError):
    """A receipt, checkpoint, proof, signed note or key that is malformed or does not check out; the message names which."""


class InternalError(LoraLedgerError, RuntimeError):
    """A bug in loraledger: one part broke the contract with another (the scheduler and the model runner, the
    scheduler and its block manager). No argument a caller passes can cause it; the message says what broke."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{message} (a bug in loraledger, not in the request: please report it with this message)")
