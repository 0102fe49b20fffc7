"""Speech primitives as plain functions and classes: CosyVoice's model directory and text frontend, token2wav,
the ASR models, scoring (text -> units, error rate, reward), the reward's components, the synthetic codebook,
prompt speakers and speaker similarity. Nothing here knows Ray, HTTP or training: the reward server
(reward_server/) composes these into a service; stage -1, evaluation, warm start and benchmarks call them directly.
"""
