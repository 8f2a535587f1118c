"""Command-line tools (run each as a script); a package too, so that benchmarks and tests import them by name."""
