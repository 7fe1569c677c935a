"""The tiny embedded target: built from a config, taught a Markov chain, used by conf/tiny.yaml and the tests."""
