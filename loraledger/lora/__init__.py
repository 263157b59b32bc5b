"""LoRA adapters: what a request names, how a PEFT folder is read and fingerprinted, where an adapter lives."""
