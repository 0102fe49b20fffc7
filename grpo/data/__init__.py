"""The data room: stage 0 (stage.py) and the recipe's public data fetched and converted once (sources.py,
lhotse_cuts.py)."""
