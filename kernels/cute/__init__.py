"""The CuTe DSL kernel family (Hopper). Not built yet: plans never choose it."""
