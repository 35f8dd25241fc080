"""TOPLOC proofs of a rollout's final hidden states: built by the rollout workers, checked by the verifier.

toploc.py       the proof format, building proofs and checking them against a prefill (the algorithm is there)
gf.py           the prime-field arithmetic the proofs' polynomials are computed in
conformance.py  `rlfleet toploc conformance`: the reference implementation's vectors, checked byte for byte
Nothing here imports a service.
"""
