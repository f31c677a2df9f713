"""Readiness of leaves and last readers of taps and activations."""

from __future__ import annotations

from types import SimpleNamespace as Use

from torchgram.backends.structured.lifetimes import Lifetimes


def test_a_leaf_is_ready_once_every_tap_of_its_uses_is_in():
    uses = {0: (Use(tap=0, act=0), Use(tap=2, act=1)), 1: (Use(tap=1, act=None),),
            2: (Use(tap=2, act=1),)}
    lifetimes = Lifetimes(uses, [0, 1, 2])
    assert lifetimes.arrived(2) == [2]
    assert lifetimes.arrived(2) == []  # once only
    assert lifetimes.arrived(1) == [1]
    assert lifetimes.arrived(0) == [0]


def test_taps_and_activations_go_with_their_last_reader():
    uses = {0: (Use(tap=0, act=0), Use(tap=1, act=0)), 1: (Use(tap=1, act=0),),
            2: (Use(tap=0, act=None),)}
    lifetimes = Lifetimes(uses, [0, 1, 2])
    assert lifetimes.done(1) == ([], [])
    assert lifetimes.done(0) == ([1], [0])
    assert lifetimes.done(2) == ([0], [])


def test_leaves_the_contraction_does_not_handle_do_not_count():
    uses = {0: (Use(tap=0, act=0),), 1: (Use(tap=0, act=0),)}
    lifetimes = Lifetimes(uses, [0])
    assert lifetimes.arrived(0) == [0]
    assert lifetimes.done(0) == ([0], [0])
