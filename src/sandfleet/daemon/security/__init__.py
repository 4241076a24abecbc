"""Who may do what: projects, tokens and quotas (iam, tenancy), the audit stream, detectors."""
