"""Evidence that outlives the database: a Merkle tree over the log, signed checkpoints, witnesses, receipts (EVIDENCE.md)."""
