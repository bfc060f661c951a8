"""moe_runtime.tuning.dictionary.AdaptiveDictionary driven by a fake clock: a cost table
cost(config, capacity) stands for the step time, a loop stands for training
(choose, run, report), and brute force over every configuration is the
reference for what the search must find, within Tutel's trial bound."""

from __future__ import annotations

import ast
import json
import math
import os
import random
import statistics
import sys

import pytest

from moe_runtime.tuning.dictionary import DATA_PARALLEL, FLOWS, AdaptiveDictionary, Config, Entry, flow_config

TUNING_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "moe_runtime", "tuning")
# The dictionary and what it is made of: no torch, no a2a, nothing but the standard library.
TUNER_FILES = [os.path.join(TUNING_DIR, name) for name in ("dictionary.py", "config.py", "search.py", "store.py")]
SIGNATURE = {"world_size": 16, "local_size": 4, "num_nodes": 4, "E": 4, "M": 1024, "H": 4096, "k": 2,
             "dtype": "bfloat16", "device": "cuda"}


def all_configs(valid_rs, degrees, algos):
    """Every configuration the layer could run: brute force's search space."""
    configs = [DATA_PARALLEL]
    configs += [Config(r, d, a) for r in sorted(set(valid_rs)) if r > 0 for d in degrees for a in algos]
    return configs


def trial_bound(s, degrees, algos, flows=()):
    """Tutel's trials per key, (log_{3/2} s + 2) * |degrees| * |algos|, with log of 1 (and 0) taken as 0,
    plus one trial per other flow."""
    return ((math.log(s, 1.5) if s > 1 else 0) + 2) * len(degrees) * len(algos) + len(flows)


def tune(dictionary, capacity, cost, max_steps=100_000):
    """Train at `capacity` until its key is tuned; the configurations that ran, in order, one per trial."""
    ran = []
    for _ in range(max_steps):
        config = dictionary.choose(capacity)
        if not dictionary.tuning(capacity):
            return ran
        if not ran or ran[-1] != config:
            ran.append(config)
        dictionary.report(capacity, config, cost(config, capacity))
    raise AssertionError("the search did not end")


class ConvexCost:
    """A step time: g(r) convex over the valid r strictly between 0 and s,
    anything at r = 0 and r = s, plus a penalty >= 0 for each (d, algo) that is
    0 for one (d, algo) per r, which one varying with r, so the cost of r
    (the minimum over its (d, algo)) is g(r)."""

    def __init__(self, g, degrees, algos, seed=0):
        self.g, self.pairs = g, [(d, a) for d in degrees for a in algos]
        self.best_pair = {r: (r * 7 + seed) % len(self.pairs) for r in g}

    def __call__(self, config, capacity):
        if config.r == 0:
            return self.g[0]
        index = self.pairs.index((config.d, config.algo))
        return self.g[config.r] + 0.01 * ((index - self.best_pair[config.r]) % len(self.pairs))


def convex_g(valid_rs, shape, rng):
    """g over valid_rs for a named shape, its minimum between 0 and s 10;
    strict where it matters, so the optimum is unique."""
    s, inner = max(valid_rs), sorted(r for r in valid_rs if 0 < r < max(valid_rs))
    if shape == "inside":
        centre = s * 0.4 + 0.13
        values = [(r - centre) ** 2 for r in inner]
    elif shape == "left":
        values = [float(r) for r in inner]
    elif shape == "right":
        values = [float(-r) for r in inner]
    else:  # increasing slopes: strictly convex, the minimum anywhere
        slopes, total, values = sorted(rng.uniform(-10, 10) for _ in inner), 0.0, []
        for slope in slopes:
            total += slope
            values.append(total)
    g = {r: v + 10 - min(values) for r, v in zip(inner, values)}
    g[0] = {"dp": 5.0, "ep_mp": 13.0}.get(shape, 10 + rng.uniform(1, 20))
    g[s] = {"dp": 13.0, "ep_mp": 5.0}.get(shape, 10 + rng.uniform(1, 20))
    return g


def rs_sets(s):
    """Sets of valid r with maximum s: contiguous, powers of two, and a random subset."""
    rng = random.Random(s)
    sets = [list(range(s + 1))]
    powers = [0] + [r for r in range(1, s + 1) if r & (r - 1) == 0]
    if powers[-1] == s:
        sets.append(powers)
    sets.append(sorted({0, s} | {r for r in range(1, s) if rng.random() < 0.4}))
    return sets


@pytest.mark.parametrize("two_level", [False, True])
@pytest.mark.parametrize("shape", ["random", "inside", "left", "right", "dp", "ep_mp"])
@pytest.mark.parametrize("s", [1, 2, 3, 4, 8, 16, 64])
def test_finds_the_optimum_within_the_bound(s, shape, two_level):
    degrees = (1, 2, 4, 8)
    algos = ("linear", "2dh") if two_level else ("linear",)
    rng = random.Random(f"{s}-{shape}")
    for valid_rs in rs_sets(s):
        for seed in range(3):
            cost = ConvexCost(convex_g(valid_rs, shape, rng), degrees, algos, seed)
            dictionary = AdaptiveDictionary(degrees=degrees, warmup=1, repeats=3)
            dictionary.bind(SIGNATURE, valid_rs, two_level)
            ran = tune(dictionary, 200, cost)
            want = min(all_configs(valid_rs, degrees, algos), key=lambda c: cost(c, 200))
            assert dictionary.choose(200) == want
            assert dictionary.entries[1] == Entry(want, cost(want, 200), len(ran))
            assert dictionary.trials(200) == len(ran) <= trial_bound(s, degrees, algos)
            assert len(set(ran)) == len(ran), "a configuration was tried twice"
            assert all(c.algo == "linear" for c in ran) or two_level


# One (d, algo) is the tightest case: r = 0 counts one trial of the bound's 2 * |degrees| * |algos|.
@pytest.mark.parametrize("degrees,algos,max_s", [((1,), ("linear",), 100), ((1, 2, 4, 8), ("linear", "2dh"), 24),
                                                 ((2, 3), ("2dh",), 40)])
def test_trial_bound_for_every_position_of_the_optimum(degrees, algos, max_s):
    """The search's path depends only on where the optimum is: try every
    position, for every s up to max_s and for sets of valid r with gaps."""
    for s in range(1, max_s + 1):
        for valid_rs in rs_sets(s):
            inner = [r for r in valid_rs if 0 < r < s]
            for position in range(max(len(inner), 1)):
                g = {r: abs(i - position - 0.25) for i, r in enumerate(inner)}  # no ties
                g[0], g[s] = 9.0, 8.0
                cost = ConvexCost(g, degrees, algos)
                dictionary = AdaptiveDictionary(degrees=degrees, algos=algos, warmup=0, repeats=1)
                dictionary.bind(SIGNATURE, valid_rs, two_level=True)
                ran = tune(dictionary, 0, cost)
                assert len(ran) <= trial_bound(s, degrees, algos), (s, valid_rs, position)
                want = min(all_configs(valid_rs, degrees, algos), key=lambda c: cost(c, 0))
                assert dictionary.choose(0) == want


def test_r0_is_one_trial_and_first():
    dictionary = AdaptiveDictionary()
    dictionary.bind(SIGNATURE, [0], two_level=True)
    assert dictionary.choose(5) == Config(0, 1, "linear")
    ran = tune(dictionary, 5, lambda config, c: 1.0)
    assert ran == [DATA_PARALLEL] and dictionary.trials(5) == 1
    dictionary.bind(SIGNATURE, [0, 1, 2, 4], two_level=True)
    assert dictionary.choose(5) == DATA_PARALLEL
    ran = tune(dictionary, 5, lambda config, c: 1.0 + config.r)
    assert ran[0] == DATA_PARALLEL and DATA_PARALLEL not in ran[1:]
    assert dictionary.choose(5) == DATA_PARALLEL


def test_noise_from_four_ranks():
    """Each rank's time is the cost times (1 + up to 4% noise), and now and then
    one rank stalls 5x; the layer reports the maximum over ranks. The median of
    3 repeats keeps the search on the noiseless optimum, and four ranks fed the
    same agreed numbers decide the same thing at every step."""
    degrees, algos, valid_rs = (1, 2, 4, 8), ("linear", "2dh"), list(range(17))
    for seed in range(10):
        rng = random.Random(seed)
        g = convex_g(valid_rs, "random", rng)
        pairs = [(d, a) for d in degrees for a in algos]
        weight = {p: 1 + 0.3 * i for i, p in enumerate(rng.sample(pairs, len(pairs)))}

        def cost(config, capacity, g=g, weight=weight):  # ratios >= 1.15 between r's, 1.3 between (d, algo)
            return 1.15 ** g[config.r] * (1 if config.r == 0 else weight[(config.d, config.algo)])

        ranks = [AdaptiveDictionary(degrees=degrees, algos=algos, warmup=1, repeats=3) for _ in range(4)]
        for dictionary in ranks:
            dictionary.bind(SIGNATURE, valid_rs, two_level=True)
        step = 0
        while ranks[0].tuning(300) or step == 0:
            configs = {dictionary.choose(300) for dictionary in ranks}
            assert len(configs) == 1
            config = configs.pop()
            times = [cost(config, 300) * (1 + rng.uniform(0, 0.04)) for _ in ranks]
            if step % 4 == 1:  # never twice among a trial's 3 repeats
                times[rng.randrange(4)] *= 5
            for dictionary in ranks:
                dictionary.report(300, config, max(times))
            step += 1
        want = min(all_configs(valid_rs, degrees, algos), key=lambda c: cost(c, 300))
        assert {dictionary.choose(300) for dictionary in ranks} == {want}
        assert ranks[0].trials(300) <= trial_bound(16, degrees, algos)


def test_capacity_windows():
    def cost(config, capacity):  # the best r grows with the capacity
        return abs(config.r - capacity // 100) + config.d / 10 + 1

    dictionary = AdaptiveDictionary(window=128, degrees=(1, 2), algos=("linear",))
    dictionary.bind(SIGNATURE, [0, 1, 2, 3, 4], two_level=False)
    assert not dictionary.tuning(100) and dictionary.trials(100) == 0
    tune(dictionary, 100, cost)
    assert dictionary.choose(100) == Config(1, 1, "linear")
    trials = dictionary.trials(100)
    for capacity in (0, 5, 127):  # the same key: no new trials
        assert dictionary.choose(capacity) == Config(1, 1, "linear")
        assert not dictionary.tuning(capacity) and dictionary.trials(capacity) == trials
    assert dictionary.choose(128) != Config(1, 1, "linear") and dictionary.tuning(128)
    assert not dictionary.tuning(100)
    tune(dictionary, 300, cost)
    assert dictionary.choose(300) == Config(3, 1, "linear")
    assert set(dictionary.entries) == {0, 2}


def test_keys_tune_interleaved():
    """The capacity changes every step: both keys' searches advance, each with its own reports."""
    def cost(config, capacity):
        return abs(config.r - capacity // 100) + 1

    dictionary = AdaptiveDictionary(window=100, degrees=(1,), algos=("linear",))
    dictionary.bind(SIGNATURE, [0, 1, 2, 3, 4], two_level=False)
    for step in range(200):
        capacity = 150 if step % 2 else 350
        config = dictionary.choose(capacity)
        dictionary.report(capacity, config, cost(config, capacity))
    assert dictionary.choose(150) == Config(1, 1, "linear")
    assert dictionary.choose(350) == Config(3, 1, "linear")


def test_warmup_reports_are_dropped():
    dictionary = AdaptiveDictionary(degrees=(1,), algos=("linear",), warmup=2, repeats=3)
    dictionary.bind(SIGNATURE, [0, 1], two_level=False)
    for seconds in (100.0, 90.0, 1.0, 3.0, 2.0):  # two warmup steps, then three repeats
        assert dictionary.choose(0) == DATA_PARALLEL
        dictionary.report(0, DATA_PARALLEL, seconds)
    assert dictionary.trials(0) == 1 and dictionary.choose(0) == Config(1, 1, "linear")
    for seconds in (0.5, 0.5, 2.5, 2.5, 2.5):  # fast warmup does not count either
        dictionary.report(0, Config(1, 1, "linear"), seconds)
    assert not dictionary.tuning(0)
    assert dictionary.entries[0] == Entry(DATA_PARALLEL, 2.0, 2)


def test_forced_config_is_ignored_by_the_search():
    dictionary = AdaptiveDictionary(degrees=(1,), algos=("linear",), warmup=0, repeats=2)
    dictionary.bind(SIGNATURE, [0, 1], two_level=False)
    dictionary.report(0, DATA_PARALLEL, 1.0)  # no search yet: nothing to count
    assert dictionary.choose(0) == DATA_PARALLEL
    dictionary.report(0, DATA_PARALLEL, 5.0)
    dictionary.report(0, Config(1, 1, "linear"), 0.001)  # the user forced r = 1 on this step
    dictionary.report(0, Config(1, 4, "linear"), 0.001)  # not even in the search space
    assert dictionary.trials(0) == 0 and dictionary.choose(0) == DATA_PARALLEL
    dictionary.report(0, DATA_PARALLEL, 5.0)
    assert dictionary.choose(0) == Config(1, 1, "linear")
    dictionary.report(0, Config(1, 1, "linear"), 7.0)
    dictionary.report(0, Config(1, 1, "linear"), 7.0)
    assert dictionary.entries[0] == Entry(DATA_PARALLEL, 5.0, 2)


@pytest.mark.parametrize("factor", [2.0, 0.5])
def test_drift_tunes_again(factor):
    degrees, algos, valid_rs = (1, 2), ("linear",), [0, 1, 2, 4]
    g = {0: 9.0, 1: 5.0, 2: 4.0, 4: 6.0}
    cost = ConvexCost(g, degrees, algos)
    dictionary = AdaptiveDictionary(degrees=degrees, algos=algos, warmup=1, repeats=3, drift=0.25)
    dictionary.bind(SIGNATURE, valid_rs, two_level=False)
    tune(dictionary, 10, cost)
    best = dictionary.choose(10)
    old = dictionary.entries[0]
    assert old.config == best and old.seconds == cost(best, 10)

    dictionary.report(10, best, old.seconds * 1.2)  # within the drift: stays tuned
    dictionary.report(10, best, old.seconds * 0.9)
    dictionary.report(10, best, old.seconds * 10)  # one outlier: the median holds
    dictionary.report(10, Config(4, 1, "linear"), old.seconds * 10)  # another config: not watched
    assert not dictionary.tuning(10)
    for _ in range(3):
        dictionary.report(10, dictionary.choose(10), old.seconds * factor)
    assert dictionary.tuning(10) and dictionary.choose(10) == DATA_PARALLEL
    assert dictionary.trials(10) == 0 and dictionary.entries[0] == old  # the old entry serves until replaced

    g = {0: 3.0, 1: 5.0, 2: 4.0, 4: 6.0}  # the machine changed: data parallel is now best
    cost = ConvexCost({r: t * factor for r, t in g.items()}, degrees, algos)
    ran = tune(dictionary, 10, cost)
    assert ran[0] == DATA_PARALLEL and len(ran) == dictionary.trials(10)
    assert dictionary.entries[0] == Entry(DATA_PARALLEL, 3.0 * factor, len(ran))
    for _ in range(10):  # settled
        dictionary.report(10, dictionary.choose(10), 3.0 * factor)
    assert not dictionary.tuning(10)


def test_drift_infinite_never_tunes_again():
    dictionary = AdaptiveDictionary(degrees=(1,), algos=("linear",), drift=math.inf)
    dictionary.bind(SIGNATURE, [0, 1], two_level=False)
    tune(dictionary, 0, lambda config, c: 1.0 + config.r)
    for _ in range(10):
        dictionary.report(0, DATA_PARALLEL, 1000.0)
    assert not dictionary.tuning(0)


def train_two_keys(path, signature=SIGNATURE, writer=True):
    dictionary = AdaptiveDictionary(degrees=(1, 2), path=path)
    dictionary.bind(signature, [0, 1, 2, 4], two_level=True, writer=writer)
    for capacity in (100, 700):
        tune(dictionary, capacity, lambda config, c: 1 + abs(config.r - c // 200) + config.d / 10
             + (config.algo == "2dh") / 20)
    return dictionary


def test_file_round_trip(tmp_path):
    path = tmp_path / "tuner.json"
    first = train_two_keys(path)
    document = json.loads(path.read_text())
    assert document["format"] == "moe_runtime.tuner" and document["version"] == 2
    (name, entries), = document["tables"].items()
    assert json.loads(name)["signature"] == SIGNATURE and json.loads(name)["window"] == 128
    assert "flows" not in json.loads(name)  # a layer without other flows keeps its version 1 table name
    assert entries["0"] == {"r": 0, "d": 1, "algo": "linear", "flow": "expert", "seconds": 1.1,
                            "trials": first.trials(100)}
    assert entries["5"]["r"] == 4 and entries["5"]["d"] == 1 and entries["5"]["algo"] == "linear"
    assert os.listdir(tmp_path) == ["tuner.json"]  # the temporary file was renamed

    second = AdaptiveDictionary(degrees=(1, 2), path=path)
    second.bind(SIGNATURE, [0, 1, 2, 4], two_level=True)
    assert dict(second.entries) == dict(first.entries)
    for capacity in (100, 700):
        assert second.choose(capacity) == first.choose(capacity) and not second.tuning(capacity)
    assert "r=4 d=1 linear" in repr(second) and "[640, 768)" in repr(second)

    third = AdaptiveDictionary.from_json(first.to_json(), degrees=(1, 2))
    third.bind(SIGNATURE, [0, 1, 2, 4], two_level=True)
    assert dict(third.entries) == dict(first.entries)


def test_other_tables_are_kept_and_not_used(tmp_path):
    path = tmp_path / "tuner.json"
    early = AdaptiveDictionary(degrees=(1, 2), path=path)  # reads the file before the others write it
    train_two_keys(path, {**SIGNATURE, "H": 8192})
    train_two_keys(path)
    tables = json.loads(path.read_text())["tables"]
    assert sorted(json.loads(name)["signature"]["H"] for name in tables) == [4096, 8192]

    other = AdaptiveDictionary(degrees=(1, 2), path=path)
    other.bind({**SIGNATURE, "H": 1024}, [0, 1, 2, 4], two_level=True)
    assert dict(other.entries) == {} and other.choose(100) == DATA_PARALLEL and other.tuning(100)
    narrower = AdaptiveDictionary(degrees=(1,), path=path)  # another search space: another table
    narrower.bind(SIGNATURE, [0, 1, 2, 4], two_level=True)
    assert dict(narrower.entries) == {}

    early.bind({**SIGNATURE, "H": 2048}, [0, 1, 2], two_level=False)
    tune(early, 0, lambda config, c: 1.0 + config.r)  # saving merges with the file as it is now
    tables = json.loads(path.read_text())["tables"]
    assert sorted(json.loads(name)["signature"]["H"] for name in tables) == [2048, 4096, 8192]


def test_only_the_writer_saves(tmp_path):
    train_two_keys(tmp_path / "tuner.json", writer=False)
    assert os.listdir(tmp_path) == []


def test_rebinding_switches_tables():
    dictionary = AdaptiveDictionary(degrees=(1,), algos=("linear",), warmup=1, repeats=2)
    dictionary.bind(SIGNATURE, [0, 1], two_level=False)
    tune(dictionary, 0, lambda config, c: 1.0 + config.r)
    dictionary.bind({**SIGNATURE, "E": 8}, [0, 1, 2], two_level=False)
    assert dict(dictionary.entries) == {} and dictionary.choose(0) == DATA_PARALLEL
    dictionary.report(0, DATA_PARALLEL, 5.0)
    dictionary.report(0, DATA_PARALLEL, 5.0)
    dictionary.bind(SIGNATURE, [0, 1], two_level=False)
    assert dictionary.entries[0].config == DATA_PARALLEL and not dictionary.tuning(0)
    dictionary.bind({**SIGNATURE, "E": 8}, [0, 1, 2], two_level=False)
    assert dictionary.tuning(0) and dictionary.trials(0) == 0  # the search resumes mid-trial
    dictionary.report(0, DATA_PARALLEL, 5.0)
    assert dictionary.trials(0) == 1


ENTRY = '{{"format": "moe_runtime.tuner", "version": 1, "tables": {{"t": {{"0": {}}}}}}}'


@pytest.mark.parametrize("text,message", [
    ("{not json", "not JSON"),
    ('{"format": "something else", "version": 1, "tables": {}}', "format 'something else'"),
    ("[1, 2]", "format 'list'"),
    ('{"format": "moe_runtime.tuner", "version": 99, "tables": {}}', "version 99"),
    (ENTRY.format('{"r": 0, "d": 1, "algo": "linear", "flow": "ring", "seconds": 1, "trials": 1}'), "flow 'ring'"),
    (ENTRY.format('{"r": 2, "d": 1, "algo": "linear", "flow": "dropless", "seconds": 1, "trials": 1}'),
     "no r, d or algo"),
    (ENTRY.format('{"r": 0, "d": 1, "algo": "linear", "flows": "dropless", "seconds": 1, "trials": 1}'),
     '"flow"'),
    ('{"format": "moe_runtime.tuner", "version": 1, "tables": {"t": {"x": {}}}}', "non-negative integer"),
    ('{"format": "moe_runtime.tuner", "version": 1, "tables": {"t": {"0": {"r": 1}}}}', '"seconds"'),
    (ENTRY.format('{"r": 1, "d": 1, "algo": "ring", "seconds": 1, "trials": 1}'), "'ring'"),
    (ENTRY.format('{"r": 1, "d": 0, "algo": "linear", "seconds": 1, "trials": 1}'), "d >= 1"),
    (ENTRY.format('{"r": 1, "d": 1, "algo": "linear", "seconds": -2, "trials": 1}'), "seconds must be"),
])
def test_bad_file(tmp_path, text, message):
    path = tmp_path / "tuner.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as error:
        AdaptiveDictionary(path=path)
    assert str(path) in str(error.value)
    with pytest.raises(ValueError, match=message):
        AdaptiveDictionary.from_json(text)


def test_entry_outside_the_search_space(tmp_path):
    path = tmp_path / "tuner.json"
    train_two_keys(path)
    document = json.loads(path.read_text())
    (entries,) = document["tables"].values()
    entries["5"]["d"] = 8  # edited by hand
    path.write_text(json.dumps(document))
    dictionary = AdaptiveDictionary(degrees=(1, 2), path=path)
    with pytest.raises(ValueError, match="r=4 d=8 linear"):
        dictionary.bind(SIGNATURE, [0, 1, 2, 4], two_level=True)


@pytest.mark.parametrize("options,error,message", [
    ({"window": 0}, ValueError, "window must be >= 1"),
    ({"window": 1.5}, TypeError, "window"),
    ({"degrees": ()}, ValueError, "degrees must not be empty"),
    ({"degrees": (1, 0)}, ValueError, "degrees must be >= 1"),
    ({"degrees": (2, 2)}, ValueError, "duplicates"),
    ({"degrees": 4}, TypeError, "degrees: expected a sequence"),
    ({"algos": ("linear", "ring")}, ValueError, "'ring'"),
    ({"algos": "linear"}, TypeError, "algos: expected a sequence"),
    ({"algos": ()}, ValueError, "algos must not be empty"),
    ({"warmup": -1}, ValueError, "warmup must be >= 0"),
    ({"repeats": 0}, ValueError, "repeats must be >= 1"),
    ({"drift": 0}, ValueError, "drift must be > 0"),
    ({"drift": math.nan}, ValueError, "drift must be > 0"),
])
def test_bad_options(options, error, message):
    with pytest.raises(error, match=message):
        AdaptiveDictionary(**options)


def test_bad_calls():
    dictionary = AdaptiveDictionary()
    with pytest.raises(RuntimeError, match="bind"):
        dictionary.choose(0)
    with pytest.raises(RuntimeError, match="bind"):
        dictionary.entries  # noqa: B018
    assert "not bound" in repr(dictionary)
    with pytest.raises(ValueError, match="valid_rs must include 0"):
        dictionary.bind(SIGNATURE, [1, 2], two_level=False)
    with pytest.raises(ValueError, match="valid_rs must be >= 0"):
        dictionary.bind(SIGNATURE, [0, -1], two_level=False)
    with pytest.raises(TypeError, match="valid_rs: expected an int"):
        dictionary.bind(SIGNATURE, [0, 1.0], two_level=False)
    with pytest.raises(TypeError, match="JSON-able"):
        dictionary.bind({"device": object()}, [0, 1], two_level=False)
    with pytest.raises(ValueError, match="not two-level"):
        AdaptiveDictionary(algos=("2dh",)).bind(SIGNATURE, [0, 1], two_level=False)
    dictionary.bind(SIGNATURE, [0, 1], two_level=False)
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        dictionary.choose(-1)
    with pytest.raises(ValueError, match="seconds must be finite"):
        dictionary.report(0, DATA_PARALLEL, -1.0)
    with pytest.raises(ValueError, match="seconds must be finite"):
        dictionary.report(0, DATA_PARALLEL, math.nan)
    with pytest.raises(TypeError, match="config must be a Config"):
        dictionary.report(0, (0, 1, "linear"), 1.0)


def test_median_is_the_trial_time():
    """With repeats = 4 the median of an even count is the mean of the middle two."""
    dictionary = AdaptiveDictionary(degrees=(1,), algos=("linear",), warmup=0, repeats=4)
    dictionary.bind(SIGNATURE, [0, 1], two_level=False)
    times = [1.0, 9.0, 2.0, 3.0]
    for seconds in times:
        dictionary.report(0, dictionary.choose(0), seconds)
    for _ in range(4):
        dictionary.report(0, dictionary.choose(0), 100.0)
    assert dictionary.entries[0] == Entry(DATA_PARALLEL, statistics.median(times), 2)


@pytest.mark.parametrize("path", TUNER_FILES, ids=os.path.basename)
def test_module_imports_only_the_standard_library(path):
    with open(path, encoding="utf-8") as file:
        tree = ast.parse(file.read())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and not node.level}
    assert all(name.split(".")[0] in sys.stdlib_module_names or name == "__future__" for name in names), names


# ---------------------------------------------------------------------------
# The prior


class TablePrior:
    """A prior from a table: predicted seconds per configuration (None: no opinion); counts its calls."""

    def __init__(self, table):
        self.table, self.calls = table, []

    def __call__(self, signature, capacity, config):
        self.calls.append((capacity, config))
        return self.table(config)


@pytest.mark.parametrize("s", [1, 4, 16])
def test_prior_pruned_candidates_are_never_tried(s):
    degrees, algos, valid_rs = (1, 2, 4, 8), ("linear", "2dh"), list(range(s + 1))
    rng = random.Random(s)
    cost = ConvexCost(convex_g(valid_rs, "random", rng), degrees, algos)

    def predicted(config):  # 2dh at d = 8 and every d = 4 predicted 10x the best of their r
        if config.r == 0:
            return None
        return 10.0 if config.d == 4 or (config.d == 8 and config.algo == "2dh") else 1.0

    prior = TablePrior(predicted)
    dictionary = AdaptiveDictionary(degrees=degrees, algos=algos, warmup=0, repeats=1, prior=prior, prior_factor=4)
    dictionary.bind(SIGNATURE, valid_rs, two_level=True)
    ran = tune(dictionary, 200, cost)
    pruned = {c for c in all_configs(valid_rs, degrees, algos) if c.r and predicted(c) == 10.0}
    assert pruned and not pruned & set(ran)
    assert {capacity for capacity, _ in prior.calls} == {200}  # asked at the key's capacity
    assert all(c.r > 0 for _, c in prior.calls) or s == 0
    measured_rs = {c.r for c in ran if c.r > 0}
    assert len(ran) == 1 + 5 * len(measured_rs)  # r = 0, then 5 of the 8 (d, algo) of each r measured
    assert dictionary.skipped(200) == 3 * len(measured_rs)
    assert dictionary.trials(200) == len(ran)


@pytest.mark.parametrize("shape", ["random", "inside", "left", "right", "dp", "ep_mp"])
def test_prior_that_is_right_keeps_the_optimum(shape):
    """A prior proportional to the true cost within each r (off by up to 2x,
    less than the factor) never leaves out the optimum, and saves trials."""
    degrees, algos, valid_rs = (1, 2, 4, 8), ("linear", "2dh"), list(range(9))
    rng = random.Random(shape)
    g = convex_g(valid_rs, shape, rng)
    pairs = [(d, a) for d in degrees for a in algos]
    weight = {p: 1 + 3 * i for i, p in enumerate(rng.sample(pairs, len(pairs)))}  # 1, 4, 7, ... 22

    def cost(config, capacity):
        return g[config.r] * (1 if config.r == 0 else weight[(config.d, config.algo)])

    def predicted(config):
        return None if config.r == 0 else weight[(config.d, config.algo)] * rng.uniform(0.7, 1.4)

    dictionary = AdaptiveDictionary(degrees=degrees, algos=algos, warmup=0, repeats=1,
                                    prior=TablePrior(predicted), prior_factor=4)
    dictionary.bind(SIGNATURE, valid_rs, two_level=True)
    ran = tune(dictionary, 0, cost)
    want = min(all_configs(valid_rs, degrees, algos), key=lambda c: cost(c, 0))
    assert dictionary.choose(0) == want
    assert dictionary.skipped(0) > 0 and len(ran) < trial_bound(8, degrees, algos)


def test_prior_without_opinion_prunes_nothing_and_r0_is_never_asked_about():
    prior = TablePrior(lambda config: None)
    dictionary = AdaptiveDictionary(degrees=(1, 2), algos=("linear",), warmup=0, repeats=1, prior=prior)
    dictionary.bind(SIGNATURE, [0, 1, 2], two_level=False)
    ran = tune(dictionary, 0, lambda c, capacity: 1.0 + c.r + c.d)
    assert len(ran) == 5 and dictionary.skipped(0) == 0
    assert Config(0, 1, "linear") not in [c for _, c in prior.calls]


@pytest.mark.parametrize("options,error,message", [
    ({"prior": 3}, TypeError, "callable"),
    ({"prior": lambda *a: 1.0, "prior_factor": 1.0}, ValueError, "prior_factor"),
])
def test_prior_bad_options(options, error, message):
    with pytest.raises(error, match=message):
        AdaptiveDictionary(**options)


def test_prior_bad_prediction():
    dictionary = AdaptiveDictionary(prior=lambda *a: math.nan)
    dictionary.bind(SIGNATURE, [0, 1], two_level=False)
    with pytest.raises(ValueError, match="finite"):
        dictionary.choose(0)


# ---------------------------------------------------------------------------
# The other flows (dropless, data-centric, model-centric): one trial each


OTHER_FLOWS = FLOWS[1:]


def flow_cost(expert_cost, flow_seconds):
    """expert_cost for the expert flow's configurations, flow_seconds[flow] for the others."""
    def cost(config, capacity):
        return expert_cost(config, capacity) if config.flow == "expert" else flow_seconds[config.flow]
    return cost


@pytest.mark.parametrize("fastest", [*OTHER_FLOWS, "expert"])
@pytest.mark.parametrize("s", [1, 4, 16])
def test_each_flow_is_measured_once_and_the_fastest_is_the_entry(s, fastest):
    degrees, algos, valid_rs = (1, 2, 4, 8), ("linear", "2dh"), list(range(s + 1))
    expert = ConvexCost(convex_g(valid_rs, "random", random.Random(s)), degrees, algos)
    best_expert = min(all_configs(valid_rs, degrees, algos), key=lambda c: expert(c, 50))
    # The chosen flow beats the best expert configuration by a little; the others lose by a little.
    seconds = {flow: expert(best_expert, 50) * (0.99 if flow == fastest else 1.01) for flow in OTHER_FLOWS}
    dictionary = AdaptiveDictionary(degrees=degrees, algos=algos, warmup=1, repeats=3)
    dictionary.bind(SIGNATURE, valid_rs, two_level=True, flows=("model_centric", "dropless", "data_centric"))
    ran = tune(dictionary, 50, flow_cost(expert, seconds))
    assert [c for c in ran if c.flow != "expert"] == [flow_config(flow) for flow in OTHER_FLOWS]  # FLOWS' order
    assert len(set(ran)) == len(ran) <= trial_bound(s, degrees, algos, OTHER_FLOWS)
    want = best_expert if fastest == "expert" else flow_config(fastest)
    assert dictionary.choose(50) == want and dictionary.entries[0] == Entry(want, expert(want, 50) if
                                                                            fastest == "expert" else seconds[fastest],
                                                                            len(ran))
    # The expert flow's search is the one it runs without other flows, then the flows.
    alone = AdaptiveDictionary(degrees=degrees, algos=algos, warmup=1, repeats=3)
    alone.bind(SIGNATURE, valid_rs, two_level=True)
    assert ran[: -len(OTHER_FLOWS)] == tune(alone, 50, expert)


@pytest.mark.parametrize("degrees,algos,max_s", [((1,), ("linear",), 60), ((1, 2, 4, 8), ("linear", "2dh"), 16)])
def test_trial_bound_with_flows(degrees, algos, max_s):
    for s in range(1, max_s + 1):
        for valid_rs in rs_sets(s):
            for flows in [("dropless",), OTHER_FLOWS]:
                inner = [r for r in valid_rs if 0 < r < s]
                g = {r: abs(i - len(inner) / 3) for i, r in enumerate(inner)}
                g[0], g[s] = 9.0, 8.0
                dictionary = AdaptiveDictionary(degrees=degrees, algos=algos, warmup=0, repeats=1)
                dictionary.bind(SIGNATURE, valid_rs, two_level=True, flows=flows)
                ran = tune(dictionary, 0, flow_cost(ConvexCost(g, degrees, algos), dict.fromkeys(flows, 100.0)))
                assert len(ran) <= trial_bound(s, degrees, algos, flows), (s, valid_rs, flows)
                assert sum(c.flow != "expert" for c in ran) == len(flows)


def test_a_flow_entry_drifts_and_is_searched_again():
    dictionary = AdaptiveDictionary(degrees=(1,), algos=("linear",), warmup=0, repeats=2, drift=0.25)
    dictionary.bind(SIGNATURE, [0, 1, 2], two_level=False, flows=("data_centric",))
    tune(dictionary, 0, lambda c, capacity: 1.0 if c.flow == "data_centric" else 2.0 + c.r)
    assert dictionary.choose(0) == flow_config("data_centric")
    for _ in range(2):
        dictionary.report(0, flow_config("data_centric"), 5.0)
    assert dictionary.tuning(0) and dictionary.choose(0) == DATA_PARALLEL
    assert "data_centric" in repr(dictionary) and "flows ('data_centric',)" in repr(dictionary)


def test_flows_file_round_trip_and_their_own_table(tmp_path):
    path = tmp_path / "tuner.json"
    first = AdaptiveDictionary(degrees=(1, 2), path=path)
    first.bind(SIGNATURE, [0, 1, 2, 4], two_level=True, flows=("dropless", "model_centric"))
    tune(first, 100, lambda c, capacity: 0.5 if c.flow == "model_centric" else 1.0 + c.r)
    tune(first, 300, lambda c, capacity: 0.5 if c == Config(2, 2, "2dh") else 1.0 + (c.flow != "expert"))
    tables = json.loads(path.read_text())["tables"]
    (name, entries), = tables.items()
    assert json.loads(name)["flows"] == ["dropless", "model_centric"]
    assert entries["0"]["flow"] == "model_centric" and entries["2"]["flow"] == "expert"
    assert (entries["0"]["r"], entries["0"]["d"], entries["0"]["algo"]) == (0, 1, "linear")

    second = AdaptiveDictionary(degrees=(1, 2), path=path)
    second.bind(SIGNATURE, [0, 1, 2, 4], two_level=True, flows=("model_centric", "dropless"))  # any order
    assert dict(second.entries) == dict(first.entries)
    assert second.choose(100) == flow_config("model_centric") and not second.tuning(100)
    assert second.choose(300) == Config(2, 2, "2dh")
    assert "model_centric" in repr(second)
    third = AdaptiveDictionary.from_json(first.to_json(), degrees=(1, 2))
    third.bind(SIGNATURE, [0, 1, 2, 4], two_level=True, flows=("dropless", "model_centric"))
    assert dict(third.entries) == dict(first.entries)

    # Without the flows it is another table; with flows whose entry is not among them, the entry is refused.
    fourth = AdaptiveDictionary(degrees=(1, 2), path=path)
    fourth.bind(SIGNATURE, [0, 1, 2, 4], two_level=True)
    assert dict(fourth.entries) == {}
    document = json.loads(path.read_text())
    document["tables"][name]["0"]["flow"] = "data_centric"
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match="data_centric"):
        AdaptiveDictionary(degrees=(1, 2), path=path).bind(SIGNATURE, [0, 1, 2, 4], two_level=True,
                                                           flows=("dropless", "model_centric"))


def test_a_version_1_file_still_loads(tmp_path):
    """A file written before the flows: version 1, entries without "flow"."""
    path = tmp_path / "tuner.json"
    table = json.dumps({"signature": SIGNATURE, "window": 128, "valid_rs": [0, 1, 2, 4], "degrees": [1, 2],
                        "algos": ["linear", "2dh"]}, sort_keys=True, separators=(",", ":"))
    path.write_text(json.dumps({"format": "moe_runtime.tuner", "version": 1, "tables": {table: {
        "0": {"r": 0, "d": 1, "algo": "linear", "seconds": 1.5, "trials": 7},
        "3": {"r": 2, "d": 2, "algo": "2dh", "seconds": 0.5, "trials": 9}}}}))
    dictionary = AdaptiveDictionary(degrees=(1, 2), path=path)
    dictionary.bind(SIGNATURE, [0, 1, 2, 4], two_level=True)
    assert dict(dictionary.entries) == {0: Entry(DATA_PARALLEL, 1.5, 7), 3: Entry(Config(2, 2, "2dh"), 0.5, 9)}
    assert dictionary.choose(400) == Config(2, 2, "2dh") and not dictionary.tuning(400)
    tune(dictionary, 700, lambda c, capacity: 1.0 + c.r)  # saving rewrites it as version 2, entries kept
    document = json.loads(path.read_text())
    assert document["version"] == 2
    assert document["tables"][table]["3"] == {"r": 2, "d": 2, "algo": "2dh", "flow": "expert", "seconds": 0.5,
                                              "trials": 9}


def test_flow_configs_and_bad_flows():
    assert str(flow_config("dropless")) == "dropless" and str(Config(2, 4, "2dh")) == "r=2 d=4 2dh"
    assert flow_config("model_centric") == Config(0, 1, "linear", "model_centric") != DATA_PARALLEL
    with pytest.raises(ValueError, match="unknown flow 'ring'"):
        Config(0, 1, "linear", "ring")
    with pytest.raises(ValueError, match="no r, d or algo"):
        Config(1, 1, "linear", "dropless")
    with pytest.raises(ValueError, match="many configurations"):
        flow_config("expert")
    dictionary = AdaptiveDictionary()
    with pytest.raises(ValueError, match="unknown flow 'expert'"):
        dictionary.bind(SIGNATURE, [0, 1], two_level=False, flows=("expert",))
    with pytest.raises(ValueError, match="duplicates"):
        dictionary.bind(SIGNATURE, [0, 1], two_level=False, flows=("dropless", "dropless"))
    with pytest.raises(TypeError, match="flows: expected a sequence"):
        dictionary.bind(SIGNATURE, [0, 1], two_level=False, flows="dropless")
    dictionary.bind(SIGNATURE, [0, 1], two_level=False, flows=("dropless",))
    dictionary.report(0, flow_config("data_centric"), 1.0)  # not this layer's flow: counts for nothing
    assert dictionary.trials(0) == 0
