"""Finding what a graph cannot record (host synchronisations) and naming the user's line."""
