"""Reward server: speech tokens -> audio -> transcript -> pinyin error rate -> reward."""
