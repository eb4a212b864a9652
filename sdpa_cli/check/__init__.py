"""sdpa check: settings, export layouts, element checks, the run, hints, comparison and
manifests."""
