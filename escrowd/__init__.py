"""escrowd: the per-user holder that keeps PTY masters open while their app restarts."""

__version__ = "0.1.0"
