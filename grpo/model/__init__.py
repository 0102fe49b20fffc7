"""Stage -1 and 5: the CosyVoice LM as a Hugging Face model, its vocabulary, conversion both ways.

Importing this package registers CosyVoiceLMForCausalLM with transformers' Auto classes (cosyvoice_lm.py).
"""

from grpo.model import cosyvoice_lm  # noqa: F401
