-- Argo CD health check for kvpilot.dev/ModelDeployment, from the status the operator writes.
-- Argo CD runs it with the live object in `obj` and reads the returned table's status/message.
local hs = {}

local function find(conditions, kind)
  for _, c in ipairs(conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local status = obj.status
if status == nil or status.conditions == nil or #status.conditions == 0 then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvpilot operator to reconcile"
  return hs
end

local generation = obj.metadata.generation or 0
if (status.observedGeneration or 0) < generation then
  hs.status = "Progressing"
  hs.message = "Generation " .. generation .. " not reconciled yet"
  return hs
end

local ready = find(status.conditions, "Ready")
local degraded = find(status.conditions, "Degraded")

if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = ready.message or "Ready"
  return hs
end
if ready ~= nil and ready.reason == "ScaledToZero" then
  -- The autoscaler (or the user) chose zero replicas: nothing is wrong.
  hs.status = "Healthy"
  hs.message = "Scaled to zero"
  return hs
end
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = (degraded.reason or "Degraded") .. ": " .. (degraded.message or "")
  return hs
end

hs.status = "Progressing"
if ready ~= nil then
  hs.message = ready.message or "Not ready yet"
else
  hs.message = "Waiting for the Ready condition"
end
return hs
