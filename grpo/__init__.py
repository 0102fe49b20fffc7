"""cosyvoice-grpo: GRPO fine-tuning of the CosyVoice2 speech LLM (training side)."""

__version__ = "0.1.0"
