"""The job: its document, its lifecycle rules, the one module that queries `jobs`, its lease."""
