"""kvplane control plane: registration, pairing validation, transfer planning and job queue."""

__version__ = "0.1.0"
