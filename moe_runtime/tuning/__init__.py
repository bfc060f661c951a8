"""The dictionary that picks a configuration per capacity window (Tutel
Section 3.3), and the protocol by which a layer feeds it real steps.

- config.py: Config (flow, r, d, algorithm) and Entry;
- search.py: one key's search (r = 0, r = s, Fibonacci over the r between;
  every (d, algorithm) of an r; the other flows once);
- dictionary.py: AdaptiveDictionary (choose, report, drift, the prior);
- store.py: its JSON file; prior.py: the scale model (a2a.sim) as a prior;
- step.py: the step protocol (clock, the seconds column, trials).

config, search, store and dictionary import only the standard library.
"""
