"""Scoring: hand-checked Chinese and English cases, the reward mapping, and the synthetic codebook."""

import math
import random

import pytest

from grpo.speech.codebook import SILENCE, build_codebook
from grpo.speech.scoring import error_rate, normalize, reward_from_error_rate, text_to_units


def test_numbers_and_dates_are_normalised_before_pinyin():
    assert error_rate("他在2019年毕业。", "他在二零一九年毕业") == 0.0
    assert error_rate("会议定在3月15日。", "会议定在三月十五日") == 0.0
    assert error_rate("今年增长了15%", "今年增长了百分之十五") == 0.0
    assert text_to_units("360元") == ("san1", "bai3", "liu4", "shi2", "yuan2")


def test_punctuation_of_both_widths_is_ignored():
    assert error_rate("你好，世界！", "你好世界") == 0.0
    assert error_rate("你好,世界!?", "你好 世界。") == 0.0
    assert normalize("Hello, World! (test)", "en") == "hello world test"


def test_homophones_are_not_errors_but_wrong_readings_are():
    assert error_rate("银行的行长", "银航的航长") == 0.0          # same pinyin, other characters
    assert error_rate("银行的行长", "银形的行长") == pytest.approx(1 / 5)   # hang2 -> xing2
    assert text_to_units("这个问题很重要") [-2:] == ("zhong4", "yao4")
    assert text_to_units("请你重新说一遍")[2] == "chong2"        # polyphone read in context


def test_tone_sandhi_and_neutral_tone():
    assert text_to_units("你好") == ("ni2", "hao3")               # third-tone sandhi
    assert text_to_units("一个")[0] == "yi2" and text_to_units("一起")[0] == "yi4"
    assert text_to_units("不是")[0] == "bu2"
    assert text_to_units("我的")[-1] == "de5"                    # neutral tone as 5
    assert error_rate("你好", "泥好") == 0.0                      # ni2 hao3 either way


def test_ignore_tones_option():
    assert error_rate("妈妈", "马马") == 1.0
    assert error_rate("妈妈", "马马", ignore_tones=True) == 0.0


def test_english_words_inside_chinese_text():
    assert text_to_units("我用GPU训练") == ("wo3", "yong4", "gpu", "xun4", "lian4")
    assert error_rate("我用GPU训练", "我用gpu训练") == 0.0
    assert error_rate("我用GPU训练", "我用CPU训练") == pytest.approx(1 / 5)


def test_english_word_error_rate():
    assert error_rate("Hello, world!", "hello world", "en") == 0.0
    assert error_rate("the cat sat", "the dog sat", "en") == pytest.approx(1 / 3)
    assert error_rate("I have 20 apples", "i have twenty apples", "en") == 0.0


def test_empty_hypothesis_and_reference():
    assert error_rate("今天天气很好", "") == 1.0
    assert error_rate("今天天气很好", "，。") == 1.0
    with pytest.raises(ValueError):
        error_rate("", "你好")
    with pytest.raises(ValueError):
        error_rate("！？", "你好")
    with pytest.raises(ValueError):
        error_rate("你好", "你好", "fr")


def test_insertions_can_push_the_rate_above_one():
    assert error_rate("好", "好好好") == 2.0


def test_reward_mapping():
    assert reward_from_error_rate(0.0) == 1.0
    assert reward_from_error_rate(0.1) == pytest.approx(1 - math.tanh(0.3))
    assert reward_from_error_rate(5.0) == pytest.approx(0.0, abs=1e-12)
    assert reward_from_error_rate(0.1, "linear", 2.0) == pytest.approx(0.8)
    assert reward_from_error_rate(1.0, "linear", 2.0) == 0.0            # clipped
    assert reward_from_error_rate(0.5, "exp", 1.0) == pytest.approx(math.exp(-0.5))
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            reward_from_error_rate(bad)
    with pytest.raises(ValueError):
        reward_from_error_rate(0.1, "cubic")


def test_codebook_is_seeded_and_covers_only_the_given_units():
    texts = [("今天天气很好", "zh"), ("Hello world", "en")]
    a, b = build_codebook(texts, 600, 0.3, seed=1), build_codebook(texts, 600, 0.3, seed=1)
    c = build_codebook(texts, 600, 0.3, seed=2)
    assert a.token_to_unit == b.token_to_unit and a.token_to_unit != c.token_to_unit
    assert set(a.units) == {"jin1", "tian1", "qi4", "hen3", "hao3", "hello", "world"}
    assert sum(u == SILENCE for u in a.token_to_unit) == 180
    rng = random.Random(0)
    tokens = a.tokens_for_text("今天天气很好", "zh", rng, silence_prob=0.5)
    assert a.transcribe(tokens) == list(text_to_units("今天天气很好"))
    assert len(tokens) > 6          # silence was sprinkled in and is dropped by transcribe
    with pytest.raises(ValueError):
        a.transcribe([600])
    with pytest.raises(KeyError):
        a.tokens_for_text("猫", "zh", rng)


def test_no_script_is_dropped_and_character_variants_agree():
    assert error_rate("二零二四年", "二〇二四年") == 0.0                  # 〇 is Han for pypinyin: ling2, as 零
    assert text_to_units("\U00020000好")[1] == "hao3" and len(text_to_units("\U00020000好")) == 2  # CJK ext. B kept
    assert text_to_units("你好ですか") == ("ni2", "hao3", "ですか")          # kana kept as a word
    assert error_rate("你好", "你好ですか") == pytest.approx(1 / 2)          # one inserted unit over two
    assert text_to_units("café", "en") == ("café",) and error_rate("café", "caf", "en") == 1.0
    assert text_to_units("Ελλάδα 한국", "en") == ("ελλάδα", "한국")           # case-folded, never dropped
    assert text_to_units("這個") == text_to_units("这个") == ("zhe4", "ge5")   # traditional -> simplified first


def test_english_apostrophes_decades_and_dollars():
    assert error_rate("I don't know", "I dont know", "en") == pytest.approx(1 / 3)   # one word of three
    assert error_rate("I don\u2019t know", "i don't know", "en") == 0.0             # typographic apostrophe
    assert text_to_units("'quoted' words", "en") == ("quoted", "words")
    assert normalize("the 1990s", "en") == "the nineteen nineties"
    assert normalize("in the 2000s", "en") == "in the two thousands"
    assert normalize("$5.50", "en") == "five dollars fifty cents"
    assert normalize("$1", "en") == "one dollar" and normalize("$2.01", "en") == "two dollars one cent"
    assert error_rate("It costs $5.50.", "it costs five dollars fifty cents", "en") == 0.0
    assert error_rate("I have 20 apples", "i have twenty apples", "en") == 0.0       # plain numbers: wetext
