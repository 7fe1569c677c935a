"""The quality bench's references: tau replayed on greedy output, the n-gram drafter, copy shares (no model)."""
from __future__ import annotations

from app.tiny.references import NgramDrafter, copy_shares, tau_on_greedy


def oracle(greedy, prompt_len):
    """A proposer that knows the greedy text: every draft is accepted."""
    return lambda prefix, n: list(greedy[len(prefix) - prompt_len:][:n])


def test_perfect_drafter_gets_the_whole_block_and_a_wrong_one_gets_one():
    prompt, greedy = [1, 2, 3], list(range(10, 58))  # 48 tokens, no EOS
    per = tau_on_greedy(oracle(greedy, len(prompt)), prompt, greedy, block_size=8, max_new_tokens=48)
    # 1 token from the prefill, then 47 = 5 full blocks of 8 + the last 7 cut by the budget.
    assert per == [8, 8, 8, 8, 8, 7] and sum(per) == 47
    wrong = tau_on_greedy(lambda prefix, n: [0] * n, prompt, greedy, 8, 48)
    assert wrong == [1] * 47


def test_replay_stops_at_eos_like_spec_decoding():
    eos = 99
    greedy = [5, 6, 7, eos]  # plain greedy ended at EOS after 4 tokens
    per = tau_on_greedy(oracle(greedy, 1), [1], greedy, block_size=8, max_new_tokens=48)
    assert per == [3]  # the drafts are cut at the EOS slot: 6, 7 accepted, EOS is the target's token


def test_partial_acceptance_counts_the_matching_prefix():
    greedy = [10, 11, 12, 13, 14, 15, 16]
    guesses = {1: [11, 12, 0], 3: [13, 0, 0], 4: [14, 15]}  # keyed by tokens generated so far

    def propose(prefix, n):
        return guesses.get(len(prefix) - 1, [0] * n)[:n]

    per = tau_on_greedy(propose, [1], greedy, block_size=4, max_new_tokens=7)
    # after [10]: 11, 12 accepted + 13 -> 3 tokens; after 4 tokens: 14, 15 accepted + 16 -> budget reached
    assert per == [3, 3]


def test_ngram_drafter_uses_the_longest_context_and_only_response_positions():
    seqs = [([1, 2, 3, 4, 5], [0, 0, 1, 1, 1]), ([9, 3, 7], [0, 0, 1])]
    ng = NgramDrafter(seqs, n=2)
    assert ng.next_token([2, 3]) == 4  # order 2: (2, 3) -> 4
    assert ng.next_token([9, 3]) == 7  # order 2: (9, 3) -> 7, though (3,) alone ties 4 and 7
    assert ng.next_token([8, 3]) == 4  # backs off to (3,): 4 and 7 once each, the smaller id wins
    assert (1,) not in ng.table  # 1 -> 2 is a prompt position (mask 0): not counted
    assert ng([2, 3], 3) == [4, 5, ng.fallback]


def test_copy_shares_count_prompt_and_self_repetition():
    prompt = [1, 2, 3, 4]
    n, from_prompt, from_context = copy_shares(prompt, [5, 6, 5, 6, 5])
    assert (n, from_prompt) == (5, 0)
    assert from_context == 1  # only the last token: its trigram (5, 6, 5) was generated before
    n, from_prompt, _ = copy_shares(prompt, [1, 2, 3])  # trigrams (3,4,1), (4,1,2), (1,2,3): the last is in the prompt
    assert (n, from_prompt) == (3, 1)
