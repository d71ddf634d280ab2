"""What agents and their clients say to each other: the data-plane frames, addresses and the
typed shape of what an agent reports. Imported by both the SDK and the daemon, never the other
way round."""
