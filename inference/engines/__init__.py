"""Engine adapters: one client per engine kind, plus the local launcher."""
