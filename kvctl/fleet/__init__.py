"""Acting on the fleet: picking target nodes, fanning calls out to their agents, status,
lookups, health checks, and the audit trail of what operators did. No UI code here."""
