"""The version of sdpa: one place, read by the package, the reports and the build."""

__version__ = "0.1.0"
