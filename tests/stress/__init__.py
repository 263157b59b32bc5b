"""Crash stress for the audit log: engine child processes killed with SIGKILL, and the checks that follow each kill."""
