"""The quality bench's references: tau replayed on greedy output, the n-gram drafter, copy shares (no model)."""
from __future__ import annotations

from app.model.references import NgramDrafter, copy_shares, tau_on_greedy


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


def test_prompt_lookup_takes_the_longest_suffix_at_its_most_recent_occurrence():
    from app.model.references import prompt_lookup

    ctx = [1, 2, 3, 9, 1, 2, 3, 8, 7, 4, 2, 3]
    # n=4 (4, 2, 3 preceded by 7) never occurred; n=3 (4, 2, 3) neither; n=2 (2, 3): most recent at index 5 -> 8, 7, 4, 2, 3
    assert prompt_lookup(ctx, 3) == [8, 7, 4]
    assert prompt_lookup([5, 1, 2, 3, 6, 0, 1, 2, 3, 7, 9, 9, 1, 2, 3], 2) == [7, 9]  # n=3 wins; the later match
    # a longer match beats a more recent shorter one: (1, 2) at index 0 vs (2,) at index 3
    assert prompt_lookup([1, 2, 5, 2, 6, 1, 2], 1) == [5]


def test_prompt_lookup_falls_back_to_shorter_matches_and_stops_at_the_end():
    from app.model.references import prompt_lookup, prompt_lookup_proposer

    assert prompt_lookup([4, 5, 6, 7], 5) == []  # no token repeats
    assert prompt_lookup([], 5) == [] and prompt_lookup([3], 5) == []
    assert prompt_lookup([4, 5, 6, 5], 15) == [6, 5]  # only (5,) matches; two tokens follow before the end
    assert prompt_lookup([7, 7, 7], 15) == [7]  # (7, 7) at 0 overlaps the suffix: one token follows it
    assert prompt_lookup([1, 2, 3, 1, 2, 3, 1, 2], 4) == [3, 1, 2]  # guesses end where the context ends
    assert prompt_lookup([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4], 15, max_n=1) == [1, 2, 3, 4]  # n capped at 1
    assert prompt_lookup_proposer(max_n=2)([9, 1, 2, 8, 1, 2], 1) == [8]


def test_prompt_lookup_replayed_on_greedy_accepts_a_copied_span():
    from app.model.references import prompt_lookup_proposer

    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    greedy = [3, 4, 5, 6, 7, 8, 99]  # the target copies the prompt's tail, then stops at EOS 99
    per = tau_on_greedy(prompt_lookup_proposer(), prompt, greedy, block_size=16, max_new_tokens=64)
    # prefill gives 3; (3,) matches index 2 -> 4 5 6 7 8 proposed; all accepted, then the target's 99
    assert per == [6]
