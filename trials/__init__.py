"""The trial job: one process per rank, a JSON spec in and a JSON result out."""
