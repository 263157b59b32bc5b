"""Audit-trail queries, verification and compliance report export over the loraledger audit store."""

from loraledger.audit.log import AuditLog

__all__ = ["AuditLog"]
