"""The Kubernetes API side: the shared API client, claim reads, slices, events."""
