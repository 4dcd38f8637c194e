"""The campaign report: what won, by how much, why, what it cost, and whether to trust it
(``autotune report``), and two campaigns compared (``autotune compare``)."""
