"""The app's screens: chat (main), tuner, help."""
