"""Random-weight stand-ins, CPU profiles and tests only: the tiny and realsize builds of every model the pipeline
loads (CosyVoice2's directory, SenseVoiceSmall, the evaluation ASRs), in the released file layouts, and the tiny
LLM's warm start. Nothing a GPU user runs with real weights lives here: stage -1 of the cosyvoice2 profile
downloads instead (grpo/model/prepare.py), and every later stage loads both the same way. The config templates
these builds fill are the files in templates/.
"""

from pathlib import Path

TEMPLATES = Path(__file__).with_name("templates")
FRAGMENTS = ("sanm_encoder", "wav_frontend")      # shared by the funasr configs, inserted as {sanm_encoder} etc.


def render(name: str, **values) -> str:
    """templates/<name> with its {placeholders} filled from `values` and the shared fragments."""
    fragments = {f: (TEMPLATES / f"{f}.yaml").read_text(encoding="utf-8") for f in FRAGMENTS}
    return (TEMPLATES / name).read_text(encoding="utf-8").format(**fragments, **values)
