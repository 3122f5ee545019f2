"""Throwaway Flower App exercising the Message API (one ``query`` round)."""
