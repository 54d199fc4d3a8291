"""Everything that runs inside one worker; never imports ray."""
