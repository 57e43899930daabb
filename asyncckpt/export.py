"""Hugging Face safetensors export of a committed checkpoint: ``export_step`` writes a step's
export again (after ``ExportFailed``, say); ``HFExport`` says what a save exports. The export
itself is written by the worker (``asyncckpt.worker.export``)."""

from asyncckpt.worker.export import HFExport, export_step, read_full_state

__all__ = ["HFExport", "export_step", "read_full_state"]
