"""Test helpers: plain-torch references for every native kernel."""
