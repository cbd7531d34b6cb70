"""Cluster packing simulator: how well DRA placements pack a stream of GPU pods."""
