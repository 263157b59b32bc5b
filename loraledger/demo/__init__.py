"""`loraledger demo`: SmolLM2-135M-Instruct from the package index, two LoRA adapters fine-tuned on it on the spot
(a pirate's voice, text-to-SQL), one mixed batch, and the audit log's proof of which adapter wrote which answer."""
